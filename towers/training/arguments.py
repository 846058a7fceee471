"""The checks of ``fit``'s Keras arguments, Keras' validation schedule, and the
seed of ``fit``'s shuffle (``towers/training/loop.py``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from towers.training.checkpoint import TrainingCheckpoint


def should_validate(epoch: int, freq: int | Sequence[int]) -> bool:
    """Keras' rule: every ``freq`` epochs, or after those (from 1) listed."""
    if isinstance(freq, int):
        return (epoch + 1) % freq == 0
    return epoch + 1 in freq


def shuffle_seed(shuffle: bool | int, checkpoint: TrainingCheckpoint, workers) -> int:
    """The seed of ``fit``'s shuffle of array data: the resumed checkpoint's if
    it has one (a resumed run's later epochs then come in the uninterrupted
    run's orders), else ``shuffle`` if it is a seed, else one drawn from NumPy's
    generator; in a cluster, the chief's. Saved with the checkpoints."""
    saved = checkpoint.saved("shuffle_seed")
    saved = None if saved is None or saved < 0 else saved  # -1: it shuffled nothing
    given = None if isinstance(shuffle, bool) else shuffle
    if saved is not None:
        if given is not None and given != saved:
            warnings.warn(
                f"fit was given shuffle={given}, but the checkpoint it resumes "
                f"shuffled with seed {saved}; resuming with {saved}, so the "
                "examples come in the uninterrupted run's order",
                stacklevel=3,
            )
        seed = saved
    else:
        seed = given if given is not None else int(np.random.randint(2**31 - 1))
    if workers is not None:
        seed = workers.agree(seed)
    if checkpoint.directory is not None:
        checkpoint.shuffle_seed.assign(seed)
    return seed


def check_inputs(x: Any, name: str = "x") -> None:
    """Refuses inputs that are None, by ``name``.

    >>> check_inputs(None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: x must be the inputs (arrays, tensors, ...); received None
    """
    if x is None:
        raise ValueError(
            f"{name} must be the inputs (arrays, tensors, a dict or list of them, "
            "a tf.data.Dataset, a generator or a keras.utils.PyDataset); "
            "received None"
        )


def check_fit_arguments(
    verbose: Any,
    validation_split: Any,
    initial_epoch: Any,
    validation_freq: Any,
    shuffle: Any,
    epochs: Any = 1,
) -> int:
    """Refuses what Keras' ``fit`` refuses; returns ``verbose`` as 0, 1 or 2."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0; received {epochs!r}")
    if not isinstance(shuffle, (bool, int)) or (
        not isinstance(shuffle, bool) and shuffle < 0
    ):
        raise ValueError(
            "shuffle must be True, False or a seed (an integer >= 0); received "
            f"{shuffle!r}"
        )
    verbose = 1 if check_verbose(verbose) == "auto" else verbose
    if (
        isinstance(validation_split, bool)
        or not isinstance(validation_split, (int, float))
        or not 0 <= validation_split < 1
    ):
        raise ValueError(
            f"validation_split must be in [0, 1); received {validation_split!r}"
        )
    if (
        isinstance(initial_epoch, bool)
        or not isinstance(initial_epoch, int)
        or (initial_epoch < 0)
    ):
        raise ValueError(
            f"initial_epoch must be an integer >= 0; received {initial_epoch!r}"
        )
    freqs = validation_freq if isinstance(validation_freq, (list, tuple)) else None
    if freqs is None:
        check_positive("validation_freq", validation_freq)
    else:
        for value in freqs:
            check_positive("validation_freq", value)
    return verbose


def check_fit_extras(
    steps: dict[str, Any], callbacks: Sequence[Any], checkpoint_dir: str | None
) -> None:
    """Refuses a step count or batch size (``steps``, by name) that is not
    a positive integer, and ``keras.callbacks.BackupAndRestore`` beside
    ``checkpoint_dir``, which would each restore the run."""
    for name, value in steps.items():
        if value is not None:
            check_positive(name, value)
    check_callbacks(callbacks)
    if checkpoint_dir is not None and any(
        isinstance(c, keras.callbacks.BackupAndRestore) for c in callbacks
    ):
        raise ValueError(
            "fit was given both keras.callbacks.BackupAndRestore and "
            f"checkpoint_dir={checkpoint_dir!r}; they would each restore the "
            "run. Use checkpoint_dir alone (it also resumes inside an epoch, "
            "at the position in the data) or BackupAndRestore alone."
        )


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuses a callback that is not a ``keras.callbacks.Callback``.

    >>> check_callbacks([print])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: callbacks must be keras.callbacks.Callback objects; received ...
    """
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError(
                "callbacks must be keras.callbacks.Callback objects; received "
                f"{callback!r} (a {type(callback).__name__}) among them"
            )


def check_class_weight(class_weight: Any) -> None:
    """Refuses a ``class_weight`` that is not a dict of class index to weight.

    >>> check_class_weight([1.0, 2.0])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: class_weight must be a dict {class index: weight}; received a list
    """
    if class_weight is not None and not isinstance(class_weight, Mapping):
        raise ValueError(
            "class_weight must be a dict {class index: weight}; received a "
            f"{type(class_weight).__name__}"
        )


def check_verbose(verbose: Any) -> int | str:
    """Refuses a ``verbose`` other than 0, 1, 2 or ``"auto"``; returns it.

    >>> check_verbose("auto")
    'auto'
    """
    if verbose != "auto" and (verbose not in (0, 1, 2) or isinstance(verbose, bool)):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto'; received {verbose!r}")
    return verbose


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; received {value!r}")

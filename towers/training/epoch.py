"""One epoch of ``fit`` (its steps, the checkpoints within it, the validation
after it) and the checks of ``fit``'s Keras arguments (``towers/training/loop.py``)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.training.checkpoint import TrainingCheckpoint
from towers.training.data import as_dataset, unpack
from towers.training.preemption import Preemption
from towers.training.progress import Progress
from towers.training.summaries import TrainingLog


@dataclasses.dataclass
class Run:
    """What stays the same for every epoch of one fit."""

    engine: Any  # the towers.training.loop.Trainer being fitted
    dataset: tf.data.Dataset  # one epoch's batches
    epochs: int
    steps_per_epoch: int | None
    verbose: int
    callbacks: keras.callbacks.CallbackList
    checkpoint: TrainingCheckpoint
    checkpoint_every: int | None
    log: TrainingLog
    preemption: Preemption | None = None
    last_epoch: tuple[int, float] = (0, 0.0)  # its steps done and seconds


def train_epoch(run: Run, epoch: int, skip: int, batches: Any) -> dict[str, float]:
    """One epoch from batch ``skip`` on, reading ``batches`` (an iterator that
    stands after the first ``skip``); returns the epoch's loss and metrics."""
    engine = run.engine
    if skip == 0:  # else the checkpoint restored the epoch's metrics so far
        engine.reset_metrics()
    total = run.steps_per_epoch or known_length(run.dataset)
    bar = None
    if run.verbose:
        print(f"Epoch {epoch + 1}/{run.epochs}")
    if run.verbose == 1:
        bar = Progress(total)
    examples, started = 0, time.perf_counter()
    step = skip
    for batch in batches:
        x, y, sample_weight = unpack(batch)
        size = int(tf.nest.flatten(x)[0].shape[0])
        run.callbacks.on_train_batch_begin(step)
        run.log.before_step()
        run.preemption.before_step()
        step_started = time.perf_counter()
        logs = engine.train_step(x, y, sample_weight)
        # Reading the loss back waits for the step, so the time is the step's.
        logs = {name: float(np.asarray(value)) for name, value in logs.items()}
        run.log.after_step(logs, time.perf_counter() - step_started, size)
        step += 1
        examples += size
        run.callbacks.on_train_batch_end(step - 1, logs)
        # The epoch's last step is saved by the epoch-end checkpoint just after.
        saved = bool(run.checkpoint_every) and step % run.checkpoint_every == 0
        saved = saved and step != total
        if saved:
            run.checkpoint.save(epoch, step)
        if run.preemption.stop_now():
            if not saved:
                run.checkpoint.save(epoch, step)
            where = f"epoch {epoch + 1} step {step}"
            run.preemption.exit(where, run.checkpoint.directory)
        if bar is not None:
            rate = examples / max(time.perf_counter() - started, 1e-9)
            bar.update(step, {**engine.get_metrics_result(), "examples/s": rate})
    if step == skip and skip == 0:
        raise ValueError(
            f"epoch {epoch + 1} got no batches: the dataset is empty or exhausted "
            "(with steps_per_epoch, repeat() the dataset)"
        )
    if bar is not None and total is None:
        bar.update(step, engine.get_metrics_result(), done=True)
    run.last_epoch = (step, time.perf_counter() - started)
    return engine.get_metrics_result()


def validate(run: Run, batches: tf.data.Dataset) -> dict[str, float]:
    """The validation results, as ``val_<name>``; printed under the bar."""
    results = run.engine.evaluate(batches)
    if run.verbose == 1:
        print(
            "  "
            + " - ".join(Progress.format(f"val_{k}", v) for k, v in results.items())
        )
    return {f"val_{name}": value for name, value in results.items()}


def validation_batches(
    data: Any, batch_size: int | None, steps: int | None
) -> tf.data.Dataset:
    """``fit``'s validation data as batches: a dataset, or ``(x, y[, sw])``
    arrays in batches of ``batch_size``; its first ``steps`` batches if given."""
    if isinstance(data, tf.data.Dataset):
        batches = as_dataset(data)
    else:
        if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
            raise ValueError(
                "validation_data must be a tf.data.Dataset or a tuple (x, y) or "
                f"(x, y, sample_weight); received {type(data).__name__}"
            )
        x, y, sample_weight = (*data, None)[:3]
        batches = as_dataset(x, y, sample_weight, batch_size)
    return batches.take(steps) if steps else batches


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


def check_fit_arguments(
    verbose: Any,
    validation_split: Any,
    initial_epoch: Any,
    validation_freq: Any,
    shuffle: Any,
) -> int:
    """Refuses what Keras' ``fit`` refuses; returns ``verbose`` as 0, 1 or 2."""
    if not isinstance(shuffle, (bool, int)) or (
        not isinstance(shuffle, bool) and shuffle < 0
    ):
        raise ValueError(
            "shuffle must be True, False or a seed (an integer >= 0); received "
            f"{shuffle!r}"
        )
    if verbose == "auto":
        verbose = 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto'; received {verbose!r}")
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


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; received {value!r}")


def known_length(dataset: tf.data.Dataset) -> int | None:
    length = int(dataset.cardinality())
    return length if length >= 0 else None

"""Data that does not fit the model, named by the shapes the user gave.

Keras' own errors for input a model cannot take quote the tensor a layer was
called with. Under towers that is one tower's shard (``(4, 7)`` of a batch of
8), or the two examples the probe runs (``(2, 7)``); and their "Arguments
received" part may print the data itself. So when a step fails with a
``ValueError``, towers runs the batch through the model, and its targets
through the compiled loss, symbolically (by shapes, the batch's size left
unknown, as Keras builds a model from a batch); if that fails too, the error
names the argument, the shapes and dtypes the user gave, what the model takes,
and Keras' own words (their first part, never the data). Nothing has been
updated: the step fails while it is traced.

``fit`` checks ``validation_data`` so before its first update, when its
shapes or dtypes differ from the training data's (the same ones fit when the
training data does).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import compute_loss, compute_output_spec
from towers.split import examples_of, split_sizes
from towers.step.work.hooks import overrides, raised_in_towers


def misfit(
    model: keras.Model, batch: tuple, argument: str = "", shown: Any = None
) -> Any:
    """Why ``batch`` (``(x, y, sample_weight)``: arrays, tensors or
    ``tf.TensorSpec``) does not fit ``model``, as a message naming its x or
    y (after ``argument``, e.g. ``"validation_data's "``) and the shapes of
    ``shown`` (default: ``batch``); None when it fits.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> print(misfit(model, (np.zeros((4, 5)), None, None)))
      ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
      x does not fit the model: received float64 (4, 5); the model takes
      float32 (None, 3). Keras: Input 0 ... of layer ... is incompatible ...
      received input with shape (None, 5)
    """
    shown_x, shown_y, _ = _shown(batch, shown)
    try:
        x, y, sample_weight = keras.tree.map_structure(_symbolic, batch)
    except Exception:  # noqa: BLE001 - leaves without a shape: nothing to say
        return None
    try:
        y_pred = compute_output_spec(model, x, training=False)
    except ValueError as error:
        inputs = getattr(model, "inputs", None) or None
        takes = "what its call takes" if inputs is None else describe(inputs)
        return (
            f"{argument}x does not fit the model: received {describe(shown_x)}; "
            f"the model takes {takes}. Keras: {keras_words(error)}"
        )
    except Exception:  # noqa: BLE001 - not a misfit this can name
        return None
    if y is None or overrides(model, "compute_loss"):
        return None
    try:
        compute_output_spec(
            lambda y, y_pred, w: compute_loss(model, None, y, y_pred, w, False),
            y,
            y_pred,
            sample_weight,
        )
    except ValueError as error:
        return (
            f"{argument}y does not fit the model's outputs and loss: received "
            f"{describe(shown_y)}; the model outputs {describe(y_pred)}. Keras: "
            f"{keras_words(error)}"
        )
    except Exception:  # noqa: BLE001 - not a misfit this can name
        return None
    return None


def check_fits(model: keras.Model, batch: tuple, argument: str = "", shown: Any = None):
    """Raises ``misfit``'s message, if any, as a ValueError.

    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> check_fits(model, (np.zeros((4, 3)), None, None))  # it fits
    """
    message = misfit(model, batch, argument, shown)
    if message is not None:
        raise ValueError(message)


@contextlib.contextmanager
def named_misfits(
    model: keras.Model, batch: tuple, shown: Any = None, towers: int = 1
) -> Iterator[None]:
    """Within, a ValueError from a step on ``batch`` becomes ``misfit``'s
    message (the shapes of ``shown``, default ``batch``) when the batch does
    not fit the model; where it does but the smallest of ``towers`` shares
    does not (run by shapes), one naming the shares; any other is raised as
    it is.

    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> with named_misfits(model, (np.zeros((4, 5)), None, None)):
    ...     model(np.zeros((2, 5)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: x does not fit the model: received float64 (4, 5); ...
    """
    try:
        yield
    except ValueError as error:
        if raised_in_towers(error):
            raise  # towers' own checks name what they found already
        message = misfit(model, batch, shown=shown)
        shares = _unfit_shares(model, batch, towers) if message is None else None
        if shares is not None:
            message = (
                f"towers runs the step on each tower's share of the batch "
                f"({shares} rows), and the model failed on a share where the "
                f"whole batch fits it. Keras: {keras_words(error)} A forward "
                "pass that takes rows in groups (pairs by a reshape, a top_k "
                "over the batch) needs shares it can take: a batch size that "
                "splits so, or fewer towers. Nothing was updated."
            )
        if message is None:
            raise
        raise ValueError(message) from error


def _unfit_shares(model: keras.Model, batch: tuple, towers: int) -> Any:
    """The towers' rows of ``batch``'s examples, where there are towers to
    share them and the model's pass, by shapes, fails on the smallest share
    that has rows; else None."""
    try:
        rows = examples_of(batch[0]) if towers > 1 else None
    except ValueError:  # no tensor with a batch axis: nothing to share
        return None
    if not isinstance(rows, int):
        return None
    shares = split_sizes(rows, towers)
    smallest = min(share for share in shares if share) if rows else 0
    try:
        x = keras.tree.map_structure(lambda v: _symbolic(v, smallest), batch[0])
        compute_output_spec(model, x, training=False)
    except ValueError:
        return shares
    except Exception:  # noqa: BLE001 - not a misfit this can name
        return None
    return None


def check_validation(
    model: keras.Model, training: Any, validation: Any, given: Any
) -> None:
    """Checks ``validation_data`` (``given``; its ``Source``, ``validation``)
    against the model by shapes (``check_fits``) when its batches' shapes or
    dtypes differ from the training ones' (``training``: a ``Source``)."""
    spec, known = validation.spec(), training.spec()
    if spec is None or (known is not None and _signature(spec) == _signature(known)):
        return
    spec = keras.utils.unpack_x_y_sample_weight(spec)
    shown = given if isinstance(given, (tuple, list)) else spec
    check_fits(model, spec, "validation_data's ", shown)


def _signature(spec: Any) -> Any:
    """A batches' spec without the batch size: what decides if they fit."""
    return [
        (tuple(tf.TensorShape(leaf.shape)[1:]), str(leaf.dtype), type(leaf))
        if hasattr(leaf, "shape")
        else repr(leaf)
        for leaf in keras.tree.flatten(spec)
    ]


def check_numbers(batch: tuple, argument: str = "") -> None:
    """Refuses arrays of strings in ``(x, y, sample_weight)``, naming them
    (``argument``: what they were given as, e.g. ``"validation_data's "``):
    Keras' fit reads arrays of numbers only ("Invalid dtype: str32").

    >>> check_numbers((np.zeros(2), np.array(["a", "b"]), None))
    ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: y holds strings: received y str32 (2,); Keras' fit takes ...
    """
    for name, data in zip(("x", "y", "sample_weight"), batch):
        for leaf in keras.tree.flatten(data) if data is not None else []:
            if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "US":
                raise ValueError(
                    f"{argument}{name} holds strings: received "
                    f"{describe(data, argument + name)}; Keras' fit takes arrays "
                    "of numbers: map strings to integers first (e.g. with "
                    "keras.layers.StringLookup), or pass a tf.data.Dataset to a "
                    "model that takes strings"
                )


def check_form(data: Any, argument: str) -> None:
    """Refuses a tuple that is not ``(x,)``, ``(x, y)`` or ``(x, y,
    sample_weight)``, naming ``argument`` and what the tuple held.

    >>> check_form((1, 2, 3, 4), "validation_data")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: validation_data must be (x, y) or (x, y, sample_weight) ...
    """
    if isinstance(data, (tuple, list)) and not 1 <= len(data) <= 3:
        raise ValueError(
            f"{argument} must be (x, y) or (x, y, sample_weight) (or a dataset, "
            f"generator or PyDataset); received a {type(data).__name__} of "
            f"{len(data)}: {describe(tuple(data))}"
        )


def describe(data: Any, name: str = "") -> str:
    """Shapes and dtypes, never values: ``"x['a'] float32 (16, 7)"``.

    >>> describe({"a": np.zeros((2, 3), "float32"), "b": None}, "x")
    "x['a'] float32 (2, 3), x['b'] None"
    """
    if isinstance(data, dict):
        parts = [describe(v, f"{name}[{k!r}]") for k, v in data.items()]
        return ", ".join(parts) or f"{name} {{}}".strip()
    if isinstance(data, (list, tuple)) and len(data) == 1 and not name:
        return describe(data[0])  # a model's one input
    if isinstance(data, (list, tuple)):
        parts = [describe(v, f"{name}[{i}]") for i, v in enumerate(data)]
        return ", ".join(parts) or f"{name} ()".strip()
    if data is None:
        return f"{name} None".strip()
    shape = getattr(data, "shape", None)
    dtype = getattr(data, "dtype", None)
    if shape is None or dtype is None:
        return f"{name} a {type(data).__name__}".strip()
    dims = tuple(None if d is None else int(d) for d in tf.TensorShape(shape))
    kind = " sparse" if isinstance(data, (tf.SparseTensor, tf.SparseTensorSpec)) else ""
    return f"{name} {_dtype_name(dtype)}{kind} {dims}".strip()


def keras_words(error: BaseException) -> str:
    """Keras' message without its colours, its "Exception encountered" line
    and its "Arguments received" part (which may print the data)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = text.split("Arguments received by")[0]
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("Exception encountered")
    ]
    return " ".join(lines)


def _shown(batch: tuple, shown: Any) -> tuple:
    """What an error quotes: ``shown`` (the data as given: ``(x, y,
    sample_weight)`` or Keras' tuple form) when it is arrays or tensors, else
    ``batch`` (a dataset's spec)."""
    if shown is None:
        return batch
    shown = keras.utils.unpack_x_y_sample_weight(tuple(shown))
    leaves = keras.tree.flatten(shown[0])
    return shown if leaves and all(hasattr(v, "shape") for v in leaves) else batch


def _symbolic(value: Any, rows: int | None = None) -> Any:
    """A batch's leaf as Keras' symbolic tensor of ``rows`` examples (None:
    its size unknown)."""
    if value is None:
        return None
    shape = [rows, *tf.TensorShape(value.shape)[1:]]
    sparse = isinstance(value, (tf.SparseTensor, tf.SparseTensorSpec))
    ragged = isinstance(value, (tf.RaggedTensor, tf.RaggedTensorSpec))
    dtype = _dtype_name(value.dtype)
    return keras.KerasTensor(shape, dtype, sparse=sparse, ragged=ragged)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, tf.DType):
        return dtype.name
    return np.dtype(dtype).name if not isinstance(dtype, str) else dtype

"""Input for ``fit``, ``evaluate`` and ``predict``: global batches from tf.data.

Keras' forms: a ``tf.data.Dataset`` of batches whose elements are ``x``,
``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; or arrays ``x`` (and ``y``,
``sample_weight``) cut into batches of ``batch_size``. towers' own older form, a
tuple ``(x, y)`` (or ``(x, y, sample_weight)``) passed as ``x`` with no ``y``,
is read as those arrays; a model with two inputs and no targets passes its
inputs as a dict instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import train_validation_split

# Keras' batch size for array input given none.
DEFAULT_BATCH_SIZE = 32


def as_dataset(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    class_weight: Mapping[int, float] | None = None,
    shuffle: tuple[int, int] | None = None,
) -> tf.data.Dataset:
    """A dataset of global batches, prefetched.

    Args:
      x: a ``tf.data.Dataset`` of batches, or inputs (an array, a tensor, or a
        nest of them), or the tuple ``(x, y[, sample_weight])``.
      y, sample_weight: targets and per-example weights, for array input.
      batch_size: global batch size for array input (default 32, as Keras'
        fit). The last batch may be smaller: it is trained exactly, not dropped
        or padded.
      class_weight: ``{class index: weight}``: each example's weight is
        multiplied by its class's (integer or one-hot targets of one output),
        as Keras' ``fit(class_weight=...)``; classes not named weigh 1.
      shuffle: ``(seed, epoch)``: for array input, the examples in that
        epoch's order, a permutation that follows from the two numbers alone
        (``tf.random.experimental.index_shuffle``: no random state, no global
        seed), so a resumed run rebuilds any epoch's order exactly, and a
        checkpoint of the iterator holds its position, not a buffer. None: in
        order.

    Raises:
      ValueError: a ``batch_size`` that is not a positive integer,
        ``batch_size`` or ``y`` with a dataset, a dataset with no elements, or
        ``class_weight`` with several outputs; the message says what was
        received.

    Example:
      >>> ds = as_dataset(np.zeros((5, 2)), np.ones(5), batch_size=2)
      >>> [len(x) for x, y in ds]
      [2, 2, 1]
    """
    if isinstance(x, tf.data.Dataset):
        for name, value in (
            ("batch_size", batch_size),
            ("y", y),
            ("sample_weight", sample_weight),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} is for array input; received {name}={_short(value)} "
                    "with a tf.data.Dataset, which is batched and carries its "
                    "targets already"
                )
        dataset = x
    else:
        dataset = _from_arrays(x, y, sample_weight, batch_size, shuffle)
    if dataset.cardinality() == 0:
        raise ValueError("the dataset is empty; received a dataset with 0 batches")
    if class_weight is not None:
        dataset = dataset.map(_weigh_by_class(class_weight))
    # Input is prepared on the host while the towers compute the previous step.
    return dataset.prefetch(tf.data.AUTOTUNE)


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """A dataset element as ``(x, y, sample_weight)``, None for what it lacks.

    >>> unpack((1, 2))
    (1, 2, None)
    """
    return keras.utils.unpack_x_y_sample_weight(batch)


def _from_arrays(x, y, sample_weight, batch_size, shuffle=None) -> tf.data.Dataset:
    if y is None and sample_weight is None and _is_pair(x):
        x, y, sample_weight = (*x, None)[:3]
    leaves = tf.nest.flatten(x)
    if x is None or not leaves or any(isinstance(a, (str, bytes)) for a in leaves):
        raise ValueError(
            "data must be a tf.data.Dataset, or arrays (NumPy, tensors, or a nest "
            f"of them) with batch_size; received {type(x).__name__}"
        )
    batch_size = check_batch_size(batch_size)
    # tf.data reads a list as one tensor (stacked); Keras reads it as a nest,
    # each array an input (or output) of its own.
    parts = tuple(_tuples(part) for part in (x, y, sample_weight) if part is not None)
    if sample_weight is not None and y is None:
        raise ValueError("sample_weight weighs targets; received it with y=None")
    if shuffle is None:
        return tf.data.Dataset.from_tensor_slices(parts).batch(batch_size)
    parts = tf.nest.map_structure(tf.convert_to_tensor, parts)
    last = int(tf.nest.flatten(parts)[0].shape[0]) - 1
    seed = tf.constant(shuffle, tf.int64)

    def rows(positions: tf.Tensor) -> Any:
        order = tf.random.experimental.index_shuffle(positions, seed, last)
        return tf.nest.map_structure(lambda a: tf.gather(a, order), parts)

    return tf.data.Dataset.range(last + 1).batch(batch_size).map(rows)


def _tuples(nest: Any) -> Any:
    """``nest`` with every list a tuple, as Keras' fit reads lists of arrays.

    >>> _tuples([1, {"a": [2, 3]}])
    (1, {'a': (2, 3)})
    """
    if isinstance(nest, (list, tuple)):
        return tuple(_tuples(item) for item in nest)
    if isinstance(nest, dict):
        return {key: _tuples(value) for key, value in nest.items()}
    return nest


def check_batch_size(batch_size: Any) -> int:
    """The batch size for array input: 32 for None (Keras' default).

    >>> check_batch_size(None), check_batch_size(8)
    (32, 8)
    """
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(
            "array input needs a positive batch_size; received "
            f"batch_size={batch_size!r}"
        )
    return batch_size


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple:
    """``fit(validation_split=fraction)``: ``(x, y, sample_weight,
    validation_data)``, the last ``fraction`` of the examples held out, as
    Keras' own split takes them (before any shuffling).

    Raises:
      ValueError: a dataset (it cannot be split), or too few examples to split.

    Example:
      >>> x, y, _, (vx, vy, _) = split_validation(np.arange(10), np.arange(10),
      ...                                         None, 0.2)
      >>> x.tolist(), vx.tolist()
      ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    """
    if isinstance(x, tf.data.Dataset):
        raise ValueError(
            "validation_split is for array input; received a tf.data.Dataset. "
            "Pass validation_data instead."
        )
    if y is None and sample_weight is None and _is_pair(x):
        x, y, sample_weight = (*x, None)[:3]
    (x, y, sample_weight), validation = train_validation_split(
        (x, y, sample_weight), validation_split=fraction
    )
    return x, y, sample_weight, validation


def _is_pair(x: Any) -> bool:
    """towers' older form: a tuple (x, y) or (x, y, sample_weight) of arrays."""
    return (
        isinstance(x, (tuple, list))
        and len(x) in (2, 3)
        and all(not isinstance(part, (tuple, list)) for part in x)
    )


def _weigh_by_class(class_weight: Mapping[int, float]):
    if not class_weight or not all(
        isinstance(k, (int, np.integer)) for k in class_weight
    ):
        raise ValueError(
            f"class_weight must map class indices to weights; received {class_weight!r}"
        )
    table = np.ones(max(int(k) for k in class_weight) + 1, "float32")
    for label, weight in class_weight.items():
        table[int(label)] = weight
    table = tf.constant(table)

    def weigh(*batch):
        x, y, sample_weight = unpack(batch if len(batch) > 1 else batch[0])
        if y is None or isinstance(y, (Mapping, list, tuple)):
            raise ValueError(
                "class_weight weighs the classes of one output's targets; received "
                f"targets {y!r}. Pass sample_weight per output instead."
            )
        labels = y
        if labels.shape.rank == 2 and labels.shape[-1] != 1:
            labels = tf.argmax(labels, axis=-1)  # one-hot targets
        labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
        weights = tf.gather(table, labels)
        if sample_weight is not None:
            weights = weights * tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
        return x, y, weights

    return weigh


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return (
        f"<{type(value).__name__} of shape {tuple(shape)}>"
        if shape is not None
        else repr(value)
    )

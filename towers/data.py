"""Input for ``fit`` and ``evaluate``: global batches of ``(x, y)`` from tf.data."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def as_dataset(data: Any, batch_size: int | None = None) -> tf.data.Dataset:
    """A dataset of ``(x, y)`` global batches, prefetched.

    Args:
      data: a ``tf.data.Dataset`` whose elements are ``(x, y)`` batches, or a tuple
        ``(x, y)`` of NumPy arrays / tensors (then ``batch_size`` is required).
      batch_size: global batch size for array input. The last batch may be smaller:
        it is trained exactly, not dropped or padded.

    Raises:
      ValueError: elements are not ``(x, y)``, array input without ``batch_size``, or
        a dataset with no elements.
    """
    if isinstance(data, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError(
                f"batch_size is for array input; received batch_size={batch_size} "
                "with a tf.data.Dataset, which is batched already"
            )
        dataset = data
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                "array input (x, y) needs a positive batch_size; received "
                f"batch_size={batch_size!r}"
            )
        dataset = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(batch_size)
    else:
        raise ValueError(
            "data must be a tf.data.Dataset of (x, y) batches or a tuple (x, y) of "
            f"arrays; received {type(data).__name__}"
        )
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ValueError(
            f"dataset elements must be (x, y) pairs; received elements of {spec}"
        )
    if dataset.cardinality() == 0:
        raise ValueError("the dataset is empty; received a dataset with 0 batches")
    # Input is prepared on the host while the towers compute the previous step.
    return dataset.prefetch(tf.data.AUTOTUNE)

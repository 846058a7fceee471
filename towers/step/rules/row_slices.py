"""Slices of rows apart from the batch, as one device's.

An ``Embedding`` looked up on the batch's tokens has one slice of its
gradient per token, and the towers' slices concatenated are one device's. A
lookup whose rows do not come from the batch (keras.io's ViT embeds
positions, ``Embedding(n)(ops.arange(n))``) has one slice per row on one
device, summed over the batch; on towers every tower has a slice for the
same rows, and Adam would square each (``sum_t g_t**2`` for one device's
``(sum_t g_t)**2``). So where every tower's slices index the same rows,
read from none of the batch's values, they are summed first, in tower order.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def one_devices(variable: Any, grads: list[Any], reads: Any) -> Any:
    """The towers' slices of ``variable`` summed over the same rows, where
    their indices read none of the batch (``reads``: ``forms.Reads``); None
    where they are slices of the batch's rows (or no slices)."""
    del variable
    if not all(isinstance(g, tf.IndexedSlices) for g in grads):
        return None
    shapes = {tuple(g.indices.shape) for g in grads}
    if len(shapes) > 1 or None in next(iter(shapes)):
        return None
    if any(tf.executing_eagerly() or reads(g.indices) for g in grads):
        return None
    values = tf.add_n([tf.cast(g.values, grads[0].values.dtype) for g in grads])
    return tf.IndexedSlices(values, grads[0].indices, grads[0].dense_shape)

"""The towers' gradients as one device's where adding them up is not, set
right before the placement's combine.

Slices of rows apart from the batch: a lookup whose rows do not come from
the batch (keras.io's ViT embeds positions, ``Embedding(n)(ops.arange(n))``)
has one slice per row on one device, summed over the batch; on towers
every tower has a slice for the same rows, and Adam would square each
(``sum_t g_t**2`` for one device's ``(sum_t g_t)**2``). So such slices are
summed over the same rows first, in tower order.

A value in place of a gradient (``overwrite_with_gradient``: float8's
scales and amax histories) is each tower's shard's; one device's is the
towers' elementwise maximum, Keras' own rule over accumulated steps."""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from towers.step.rules.forms import Reads


def as_one_devices(
    tower_grads: list[list[Any]], variables: list[Any], batch: Any
) -> list[list[Any]]:
    """``tower_grads[t][v]`` with each kind above as one device has it: tower
    0's, the others None (which the combine passes by)."""
    reads = Reads(batch, shapes=False)  # an eager tensor: by assumption
    out = [list(grads) for grads in tower_grads]
    for v, variable in enumerate(variables):
        grads = [grads[v] for grads in tower_grads]
        if len(grads) < 2:
            continue
        if getattr(variable, "overwrite_with_gradient", False):
            present = [g for g in grads if g is not None]
            if present:
                out[0][v] = functools.reduce(tf.maximum, present)
                for t in range(1, len(out)):
                    out[t][v] = None
            continue
        if not all(isinstance(g, tf.IndexedSlices) for g in grads):
            continue
        shapes = {tuple(g.indices.shape) for g in grads}
        if len(shapes) > 1 or None in next(iter(shapes)):
            continue
        if any(tf.executing_eagerly() or reads(g.indices) for g in grads):
            continue
        values = tf.add_n([tf.cast(g.values, grads[0].values.dtype) for g in grads])
        out[0][v] = tf.IndexedSlices(values, grads[0].indices, grads[0].dense_shape)
        for t in range(1, len(out)):
            out[t][v] = None
    return out


def combined(
    placement: Any, tower_grads: list[list[Any]], batch: Any, variables: Any = None
) -> list[Any]:
    """``tower_grads[t][v]`` (of ``variables``, the trainable ones by default)
    combined by the placement, each kind above one device's first: the one
    combine of the built-in step and of each apply of a model's own."""
    if len(placement.models) > 1:  # a copy per tower: each its own
        return placement.combine(tower_grads) if tower_grads[0] else tower_grads
    if not tower_grads[0]:  # a model without trainable variables
        return []
    if batch is not None:
        listed = placement.model.trainable_variables if variables is None else variables
        with tf.device(placement.variable_device), tf.name_scope("combine"):
            tower_grads = as_one_devices(tower_grads, listed, batch)
    return placement.combine(tower_grads, variables)

"""A model's own ``compute_loss`` that couples the batch's examples, computed
on the whole batch's outputs (``coupled_losses="exact"``).

A contrastive model (CLIP's symmetric cross-entropy, SigLIP's sigmoid loss,
SimCLR's NT-Xent) computes its loss over the batch's similarity matrix: each
example's term depends on every other example's outputs. Split over towers,
each tower's shard would see a smaller matrix, and the update would not be one
device's, however the shards are weighted. The probe finds such a loss on the
first batch (``towers/step/probe.py``); ``towers/step/coupled.py`` then sets
``gathered``, and the towers are traced in lockstep (``lockstep.py``).

In tower ``t`` (share ``w_t = n_t / B`` of the step's examples), with ``L``
the model's ``compute_loss`` of the gathered batch:

- every tower hands in its ``x``, ``y``, ``y_pred`` and ``sample_weight``, and
  takes everyone's, in example order (the shards are consecutive rows);
- ``L_t`` is ``L`` with only tower ``t``'s outputs live (the others'
  ``tf.stop_gradient``), so its gradient flows back through tower ``t``'s own
  slice of the outputs only: summed over the towers, the outputs' gradients
  are one device's;
- ``L_s`` is ``L`` with every output stopped: its gradient is only what the
  loss reads from the variables directly (a learned temperature, weight
  regularisers) and the tower's own ``add_loss`` terms (its shard's);
- the tower's term is ``L_t − (1 − w_t) · L_s``: its value is ``w_t · L``,
  so the towers' add up to ``L``, and the direct gradients add up once.

Each computation of ``L`` assigns what the model's ``compute_loss`` assigns
(its own metrics, Keras' per-output loss trackers): tower 0's ``L_t`` keeps
its assignments, every other one's is dropped (``ReadScope.forgetting``), so a
metric is updated once, with the whole batch, as on one device. Evaluation
takes ``w_t · L``, one computation per tower.

Costs: every tower computes the loss twice on the whole batch (the model's
passes are not repeated), and the towers are traced side by side. Not built:
across a cluster's workers (uneven shards to gather), ``accumulate_steps``,
XLA, and a model's own ``train_step`` calling its ``compute_loss``: refused
by name there (``coupled.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import tensorflow as tf

from towers._keras import ReadScope, compute_loss
from towers.step import lockstep


def gathered_loss(
    model: Any,
    batch: tuple[Any, Any, Any, Any],
    share: tf.Tensor,
    scope: ReadScope,
    training: bool,
) -> tf.Tensor:
    """Tower ``t``'s term of the model's ``compute_loss`` over the whole batch
    (the module docstring): ``batch`` is its ``(x, y, y_pred, sample_weight)``,
    ``share`` its ``w_t``, ``scope`` the scope its pass runs in. In a tower
    traced in lockstep only."""
    seat = lockstep.current()
    handed = seat.meet.exchange(seat.rank, batch)
    x, y, _, sample_weight = (whole([h[i] for h in handed]) for i in (0, 1, 2, 3))
    live = whole(
        [h[2] if r == seat.rank else _stopped(h[2]) for r, h in enumerate(handed)]
    )
    kept = contextlib.nullcontext() if seat.rank == 0 else scope.forgetting()
    with kept:
        loss = compute_loss(model, x, y, live, sample_weight, training)
    if not training:
        return loss * tf.cast(share, loss.dtype)
    stopped = whole([_stopped(h[2]) for h in handed])
    with scope.forgetting():
        direct = compute_loss(model, x, y, stopped, sample_weight, training)
    return loss - (1 - tf.cast(share, loss.dtype)) * direct


def concat_rows(parts: list[Any]) -> Any:
    """The towers' nests joined along the examples (None stays None).

    >>> concat_rows([{"a": tf.ones((1, 2))}, {"a": tf.zeros((2, 2))}])["a"].shape
    TensorShape([3, 2])
    """
    if parts[0] is None:
        return None
    return tf.nest.map_structure(_join, *parts)


def _join(*parts: Any) -> Any:
    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(0, list(parts))
    return tf.concat(parts, axis=0)


def whole(parts: list[Any]) -> Any:
    """The towers' nests joined along the examples, the batch dimension
    unknown to the graph as in the batches of Keras' fit: Keras' per-output
    loss trackers weigh a batch by its static size, so they count it once, as
    there."""

    def unknown(value: Any) -> Any:
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        shape = [None, *value.shape[1:]]
        return tf.compat.v1.placeholder_with_default(value, shape)

    joined = concat_rows(parts)
    return None if joined is None else tf.nest.map_structure(unknown, joined)


def _stopped(outputs: Any) -> Any:
    return tf.nest.map_structure(tf.stop_gradient, outputs)

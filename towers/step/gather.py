"""``towers.gather``: a tensor of every tower's examples, inside a model's own
``train_step`` (or ``test_step``).

A loss over the whole batch's similarity matrix (SimCLR's NT-Xent, CLIP's
symmetric cross-entropy) computed inside a model's own ``train_step`` sees only
its tower's shard, as under MirroredStrategy; towers gathers what a
``compute_loss`` override needs by itself (``towers/step/gathered.py``), but
cannot see into a step. ``towers.gather(embeddings)`` is the step's way to ask:
every tower gets the batch's rows, in example order, and computes the whole
batch's loss from them, each tower's gradient flowing back through its own
rows only, divided by its share of the examples (``n_t / B``). The towers'
gradients are weighted by those shares where they meet at the apply
(``towers/step/custom.py``), so its rows' gradients add up to one device's,
and what the loss reads directly (a learned temperature) counts once: the
shares sum to 1. Outside towers (Keras' own fit on one device) it returns the
tensor as it is, so the same step runs both ways.

In one process, with ``own_step_loss="mean"``; a cluster's workers, or a step
whose loss is a sum, are refused by name.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.combine import in_dtype
from towers.step.assignments import met_for
from towers.step.meetings import own_step_seat


def gather(value: Any) -> Any:
    """Every tower's rows of ``value`` (the first axis: its examples), in
    example order, inside a model's own step on towers; ``value`` itself
    elsewhere.

    Raises:
      ValueError: in a cluster of workers, or with ``own_step_loss="sum"``.

    Example:
      >>> import towers
      >>> towers.gather(tf.constant([[1.0], [2.0]])).numpy().tolist()  # no towers
      [[1.0], [2.0]]
    """
    here = own_step_seat()
    if here is None:
        return value
    if here.worker is not None or here.loss != "mean":
        what = "a cluster of workers" if here.worker else f"own_step_loss={here.loss!r}"
        raise ValueError(
            "towers.gather runs in one process with own_step_loss='mean' for "
            f"now; received {what}"
        )
    value = tf.convert_to_tensor(value)
    rows = here.everyone(tf.stop_gradient(value))
    meeting = rows[0].ref()  # the same tensor on every tower
    rows[here.rank] = _gradient_over(value, here.weight)
    gathered = tf.concat(rows, axis=0)
    met_for([gathered], meeting)  # the same value on every tower
    return gathered


def _gradient_over(value: tf.Tensor, share: Any) -> tf.Tensor:
    """``value``, its gradient divided by ``share`` on the way back."""
    weight = in_dtype(share, value.dtype)

    @tf.custom_gradient
    def identity(x: tf.Tensor):
        return tf.identity(x), lambda upstream: upstream / weight

    return identity(value)

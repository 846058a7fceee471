"""``towers.gather``: a tensor of every tower's examples, inside a model's own
``train_step`` (or ``test_step``).

A loss over the whole batch's similarity matrix (SimCLR's NT-Xent, CLIP's
symmetric cross-entropy) computed inside a model's own ``train_step`` sees only
its tower's shard, as under MirroredStrategy; towers gathers what a
``compute_loss`` override needs by itself (``towers/step/rules/whole_batch.py``), but
cannot see into a step. ``towers.gather(embeddings)`` is the step's way to ask:
every tower gets the batch's rows, in example order, and computes the whole
batch's loss from them, each tower's gradient flowing back through its own
rows only, divided by its share of the examples (``n_t / B``). The towers'
gradients are weighted by those shares where they meet at the apply
(``towers/step/work/own.py``), so its rows' gradients add up to one device's,
and what the loss reads directly (a learned temperature) counts once: the
shares sum to 1. Outside towers (Keras' own fit on one device) it returns the
tensor as it is, so the same step runs both ways.

In a cluster, every worker's rows are gathered too (the one gather,
``towers/step/rules/whole_batch.py``), each tower's rows' gradient divided by its
share of the global batch (``n_t / B``). Whatever its form, such a loss is
the whole batch's on every tower, so it is weighed as a mean
(``towers/step/rules/loss_kinds.py``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.combine import in_dtype
from towers.step.rules import probe
from towers.step.rules.metric_updates import met_for
from towers.step.rules.whole_batch import gathered_rows
from towers.step.run.seats import current


def gather(value: Any) -> Any:
    """Every tower's rows of ``value`` (the first axis: its examples), in
    example order, inside a model's own step on towers; ``value`` itself
    elsewhere.

    Example:
      >>> import towers
      >>> towers.gather(tf.constant([[1.0], [2.0]])).numpy().tolist()  # no towers
      [[1.0], [2.0]]
    """
    here = current()
    if not here.own:
        probe.gathered()  # a step probed: its loss is the whole batch's
        return value
    value = tf.convert_to_tensor(value)
    rows = gathered_rows(here, (tf.stop_gradient(value),))
    # The step's gradients weigh this tower by n_t / B_w and its worker by
    # B_w / B: its own rows' gradient is divided by n_t / B.
    share = in_dtype(here.weight, value.dtype)
    weight = tf.math.divide_no_nan(share, in_dtype(rows.scale, value.dtype))
    gathered = rows.with_own(0, _gradient_over(value, weight))
    met_for([gathered], rows.first[0].ref())  # the same value on every tower
    return gathered


def _gradient_over(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """``value``, its gradient divided by ``weight`` on the way back."""

    @tf.custom_gradient
    def identity(x: tf.Tensor):
        return tf.identity(x), lambda upstream: upstream / weight

    return identity(value)

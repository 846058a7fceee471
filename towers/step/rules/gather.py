"""``towers.gather``: a tensor of every tower's examples, inside a model's own
``train_step`` (or ``test_step``).

A loss over the whole batch's similarity matrix (SimCLR's NT-Xent, CLIP's)
in a model's own step sees only its tower's shard, as under
MirroredStrategy. ``towers.gather(embeddings)`` gives every tower the
batch's rows (a cluster's too), in example order; each tower's gradient
flows back through its own rows only, over its share ``n_t / B``, so the
towers' gradients, weighted by those shares at the apply, add up to one
device's. Outside towers (Keras' own fit) it returns the tensor as it is,
so the same step runs both ways."""

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

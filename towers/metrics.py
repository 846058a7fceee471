"""The loss tracker and the user's metrics, updated from every tower's predictions.

Metrics see the whole batch: the towers' predictions, concatenated in tower order,
are the batch's predictions, so a metric equals the one a single device computes.
The loss tracker is a mean weighted by each batch's examples, as Keras' ``fit``
reports an epoch's loss.

In a cluster each worker updates its metrics with its own share; the *change* of
every metric variable is then summed across workers (in the step's one
collective) and added to where the metric was, so every worker's metrics hold the
cluster's (:class:`Changes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf


@dataclasses.dataclass
class Changes:
    """How this worker's update moved its metric variables.

    Attributes:
      before: each metric variable's value before the update.
      deltas: after minus before, in the same order: what the workers sum.
    """

    before: list[tf.Tensor]
    deltas: list[tf.Tensor]


class Metrics:
    """An engine's loss tracker and metrics, living on ``device``.

    Args:
      metrics: Keras metrics, objects or names (``"mae"``,
        ``"sparse_categorical_accuracy"``), updated without sample weights.
      device: where their variables live (the variable device).
      weighted_metrics: metrics updated with the batch's sample weights.

    Raises:
      ValueError: a metric that is neither a ``keras.metrics.Metric`` nor a name.

    Example:
      >>> import numpy as np
      >>> metrics = Metrics([keras.metrics.MeanAbsoluteError(name="mae")], "/cpu:0")
      >>> y = np.zeros((3, 1), "float32")
      >>> metrics.update(y, [np.ones((2, 1), "float32"), np.full((1, 1), 4.0)])
      >>> metrics.track_loss(tf.constant(2.0), 3)
      >>> float(metrics.loss_tracker.result()), float(metrics.results()["mae"])
      (2.0, 2.0)
    """

    def __init__(
        self,
        metrics: Sequence[Any] | None,
        device: str,
        weighted_metrics: Sequence[Any] | None = None,
    ):
        self.device = device
        with tf.device(device):
            self.unweighted = [_as_metric(m) for m in metrics or []]
            self.weighted = [_as_metric(m) for m in weighted_metrics or []]
            self.metrics = self.unweighted + self.weighted
            # Keras' fit reports the epoch's loss as a mean weighted by batch size.
            self.loss_tracker = keras.metrics.Mean(name="loss")

    def update(
        self, y: Any, tower_predictions: list[Any], sample_weight: Any = None
    ) -> None:
        """Updates every metric with the batch's targets and the towers'
        predictions (in tower order, so together they are the batch's); weighted
        metrics with the sample weights too."""
        if not self.metrics:
            return
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *tower_predictions
        )
        for metric in self.unweighted:
            metric.update_state(y, y_pred)
        for metric in self.weighted:
            metric.update_state(y, y_pred, sample_weight=sample_weight)

    def update_changes(
        self, y: Any, tower_predictions: list[Any], sample_weight: Any = None
    ) -> Changes:
        """Updates the metrics, and returns how that moved their variables."""
        before = [tf.convert_to_tensor(v) for v in self._variables]
        self.update(y, tower_predictions, sample_weight)
        deltas = [tf.convert_to_tensor(v) - b for v, b in zip(self._variables, before)]
        return Changes(before, deltas)

    def set_changes(self, changes: Changes, deltas: Sequence[tf.Tensor]) -> None:
        """Sets each metric variable to its value before the update plus
        ``deltas`` (every worker's changes, summed)."""
        for var, old, delta in zip(self._variables, changes.before, deltas):
            var.assign(old + delta)

    def track_loss(self, loss: tf.Tensor, examples: Any) -> None:
        """Adds a batch's mean loss, weighted by its examples, to the tracker."""
        self.loss_tracker.update_state(
            loss, sample_weight=tf.cast(examples, tf.float32)
        )

    def results(self) -> dict[str, tf.Tensor]:
        """``{metric name: value}``, the loss tracker's not included."""
        return {m.name: m.result() for m in self.metrics}

    @property
    def _variables(self) -> list[tf.Variable]:
        return [v for m in self.metrics for v in m.variables]


def _as_metric(metric: Any) -> keras.metrics.Metric:
    if isinstance(metric, str):
        # Keras resolves "accuracy" by the loss at compile time; here the name must
        # say which one (e.g. "sparse_categorical_accuracy").
        metric = keras.metrics.get(metric)
        if not isinstance(metric, keras.metrics.Metric):
            metric = keras.metrics.MeanMetricWrapper(metric, name=metric.__name__)
    if not isinstance(metric, keras.metrics.Metric):
        raise ValueError(
            "metrics must be keras.metrics.Metric objects or names; "
            f"received {metric!r}"
        )
    return metric

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

from towers._keras import is_binary_or_sparse_categorical


@dataclasses.dataclass
class Changes:
    """How this worker's update moved its metric variables.

    Attributes:
      before: each metric variable's value before the update.
      deltas: after minus before, in the same order: what the workers sum.
    """

    before: list[tf.Tensor]
    deltas: list[tf.Tensor]


@dataclasses.dataclass
class _Entry:
    """A metric, the output it watches (None: the only one), and whether it
    takes the sample weights."""

    metric: keras.metrics.Metric
    output: str | int | None
    weighted: bool


class Metrics:
    """An engine's loss tracker and metrics, living on ``device``.

    Args:
      metrics: Keras metrics, objects or names (``"mae"``,
        ``"sparse_categorical_accuracy"``), updated without sample weights: a
        list for a model with one output; for several, a dict by output name (or
        a list per output) of lists, named ``<output>_<metric>`` as Keras does.
      device: where their variables live (the variable device).
      weighted_metrics: the same, updated with the batch's sample weights.
      output_names: the model's output names, for list outputs.
      output_losses: the outputs whose loss is reported on its own, as Keras
        reports ``<output>_loss`` (unweighted) for a model with several.

    Raises:
      ValueError: a metric that is neither a ``keras.metrics.Metric`` nor a name.

    Example:
      >>> metrics = Metrics([keras.metrics.MeanAbsoluteError(name="mae")], "/cpu:0")
      >>> y = np.zeros((3, 1), "float32")
      >>> metrics.update(y, [np.ones((2, 1), "float32"), np.full((1, 1), 4.0)])
      >>> metrics.track_loss(tf.constant(2.0), 3)
      >>> float(metrics.loss_tracker.result()), float(metrics.results()["mae"])
      (2.0, 2.0)
    """

    def __init__(
        self,
        metrics: Any,
        device: str,
        weighted_metrics: Any = None,
        output_names: Sequence[str] | None = None,
        output_losses: Sequence[str] = (),
    ):
        self.device = device
        self.output_names = list(output_names or [])
        with tf.device(device):
            self.entries = _entries(metrics, False) + _entries(weighted_metrics, True)
            # Keras' fit reports a loss as a mean weighted by each batch's size.
            self.loss_tracker = LossMean(name="loss")
            self.output_losses = {
                name: LossMean(name=f"{name}_loss") for name in output_losses
            }
            self.metrics = [entry.metric for entry in self.entries]
            self.metrics += list(self.output_losses.values())

    def update(
        self,
        y: Any,
        tower_predictions: list[Any],
        sample_weight: Any = None,
        output_losses: Any = None,
    ) -> None:
        """Updates every metric with the batch's targets and the towers'
        predictions (in tower order, so together they are the batch's); weighted
        metrics with the sample weights too. ``output_losses``: ``(values by
        output, examples)``, the batch's loss per output."""
        if output_losses is not None:
            values, examples = output_losses
            for name, tracker in self.output_losses.items():
                tracker.update_state(
                    values[name], sample_weight=tf.cast(examples, tf.float32)
                )
        if not self.entries:
            return
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *tower_predictions
        )
        for entry in self.entries:
            y_o, p_o = self._pick(y, entry.output), self._pick(y_pred, entry.output)
            if entry.weighted:
                weights = sample_weight
                if isinstance(weights, (dict, list, tuple)):
                    weights = self._pick(weights, entry.output)
                entry.metric.update_state(y_o, p_o, sample_weight=weights)
            else:
                entry.metric.update_state(y_o, p_o)

    def update_changes(
        self,
        y: Any,
        tower_predictions: list[Any],
        sample_weight: Any = None,
        output_losses: Any = None,
    ) -> Changes:
        """Updates the metrics, and returns how that moved their variables."""
        before = [tf.convert_to_tensor(v) for v in self._variables]
        self.update(y, tower_predictions, sample_weight, output_losses)
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

    def _pick(self, structure: Any, output: str | int | None) -> Any:
        """One output's part of ``y`` or ``y_pred`` (dict or list)."""
        if output is None:
            return structure
        if isinstance(structure, dict):
            if isinstance(output, int):
                return list(structure.values())[output]
            return structure[output]
        if isinstance(output, str):
            output = self.output_names.index(output)
        return structure[output]

    @property
    def _variables(self) -> list[tf.Variable]:
        return [v for m in self.metrics for v in m.variables]


class LossMean(keras.metrics.Metric):
    """A batch loss's mean over an epoch, each batch weighted by its examples:
    ``keras.metrics.Mean`` for one scalar a step, in two adds.

    >>> mean = LossMean()
    >>> mean.update_state(1.0, sample_weight=3)
    >>> mean.update_state(3.0, sample_weight=1)
    >>> float(mean.result())
    1.5
    """

    def __init__(self, name: str = "loss"):
        super().__init__(name=name)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, value: Any, sample_weight: Any = 1.0) -> None:
        weight = tf.cast(sample_weight, tf.float32)
        self.total.assign_add(tf.cast(value, tf.float32) * weight)
        self.count.assign_add(weight)

    def result(self) -> tf.Tensor:
        return tf.math.divide_no_nan(self.total, self.count)


def _entries(spec: Any, weighted: bool) -> list[_Entry]:
    """Metrics per output: a list (the model's one output), a dict by output
    name, or a list of lists (one per output)."""
    if not spec:
        return []
    if isinstance(spec, dict):
        pairs = list(spec.items())
    elif all(isinstance(item, (list, tuple)) for item in spec):
        pairs = list(enumerate(spec))
    else:
        return [_Entry(_as_metric(m), None, weighted) for m in spec]
    entries = []
    for output, metrics in pairs:
        metrics = metrics if isinstance(metrics, (list, tuple)) else [metrics]
        for metric in metrics:
            entries.append(_Entry(_named(_as_metric(metric), output), output, weighted))
    return entries


def _named(metric: keras.metrics.Metric, output: Any) -> keras.metrics.Metric:
    """The metric named ``<output>_<name>``, as Keras names per-output metrics."""
    config = {**metric.get_config(), "name": f"{output}_{metric.name}"}
    return type(metric).from_config(config)


class Accuracy(keras.metrics.MeanMetricWrapper):
    """Keras' ``"accuracy"`` (or ``"acc"``) as ``compile`` resolves it: binary,
    sparse categorical or categorical accuracy, chosen by the targets' and
    predictions' shapes (Keras' own rule). The three keep the same state (a
    total and a count), so the choice is made when the step is traced.

    >>> accuracy = Accuracy()
    >>> accuracy.update_state(np.array([2, 0]), np.array([[0.1, 0.2, 0.7]] * 2))
    >>> float(accuracy.result())  # sparse labels: one of two right
    0.5
    """

    def __init__(self, name: str = "accuracy", dtype: Any = None):
        super().__init__(fn=_accuracy, name=name, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype}


def _accuracy(y_true: Any, y_pred: Any) -> Any:
    binary, sparse = is_binary_or_sparse_categorical(y_true, y_pred)
    if binary:
        return keras.metrics.binary_accuracy(y_true, y_pred)
    if sparse:
        return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)
    return keras.metrics.categorical_accuracy(y_true, y_pred)


def _as_metric(metric: Any) -> keras.metrics.Metric:
    if isinstance(metric, str) and metric.lower() in ("accuracy", "acc"):
        return Accuracy(name=metric)  # resolved by shapes, as Keras' compile does
    if isinstance(metric, str):
        name, metric = metric, keras.metrics.get(metric)
        if not isinstance(metric, keras.metrics.Metric):
            metric = keras.metrics.MeanMetricWrapper(metric)
        metric.name = name  # as given ("mae"), as Keras' compile names it
    if not isinstance(metric, keras.metrics.Metric):
        raise ValueError(
            "metrics must be keras.metrics.Metric objects or names; "
            f"received {metric!r}"
        )
    return metric

"""The compiled model's own metrics, updated from every tower's work as Keras'
step updates them on one device, so ``model.metrics`` and Keras' callbacks
see what Keras' fit gives: the loss tracker weighted by examples, each
output's tracker once a step, the compiled metrics once with the towers'
predictions concatenated; in a cluster each change summed over the workers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers._keras import (
    build_compiled_metrics,
    compiled_metrics_unbuilt,
    loss_tracker,
    output_loss_trackers,
)


@dataclasses.dataclass
class Changes:
    """Metric variables and their values before a step's towers, to sum each
    one's change over the workers."""

    variables: list[Any]
    before: list[tf.Tensor]

    def deltas(self) -> list[tf.Tensor]:
        """Each variable's change since: what the workers sum."""
        pairs = zip(self.variables, self.before)
        return [tf.convert_to_tensor(v) - b for v, b in pairs]

    def set(self, deltas: Sequence[tf.Tensor]) -> None:
        """Sets each variable to its value before plus ``deltas`` (every
        worker's changes, summed)."""
        for var, old, delta in zip(self.variables, self.before, deltas):
            var.assign(old + delta)


class Metrics:
    """The engine's model's metrics, updated with every tower's work.

    Args:
      model: a zero-arg function returning the compiled model (asked on each
        use: a balanced placement rebuilds a lazily built model).
      device: where the metrics' variables are built (the variable device).

    Example:
      >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
      >>> model.compile(loss="mse", metrics=["mae"])
      >>> metrics = Metrics(lambda: model, "/cpu:0")
      >>> x, y = np.zeros((3, 1), "float32"), np.zeros((3, 1), "float32")
      >>> metrics.build(x, y)
      >>> # Two towers' predictions, 2 and 1 examples: the batch's 3.
      >>> metrics.update(x, y, [np.ones((2, 1), "float32"), np.full((1, 1), 4.0)])
      >>> metrics.track(tf.constant(2.0), 3, outputs={})
      >>> {name: float(value) for name, value in metrics.results().items()}
      {'loss': 2.0, 'mae': 2.0}
    """

    def __init__(self, model: Callable[[], keras.Model], device: str):
        self._model = model
        self.device = device

    @property
    def model(self) -> keras.Model:
        return self._model()

    @property
    def loss_tracker(self) -> keras.metrics.Metric:
        """The model's loss tracker: an epoch's loss, each batch weighted by
        its examples, as Keras' fit reports it."""
        return loss_tracker(self.model)

    @property
    def built(self) -> bool:
        """Whether nothing waits for a batch's shapes."""
        model = self.model
        compiled = getattr(model, "compiled", False)
        return not compiled or not compiled_metrics_unbuilt(model)

    def build(self, x: Any, y: Any = None, sample_weight: Any = None) -> None:
        """Builds the compiled metrics from a batch's shapes, as Keras' first step."""
        if not self.built:
            # An optional input given None: a dataset's NoneTensorSpec, a
            # generator's OptionalSpec.
            none = (tf.NoneTensorSpec, tf.OptionalSpec)
            batch = tf.nest.map_structure(
                lambda v: None if isinstance(v, none) else v,
                (x, y, sample_weight),
            )
            with tf.device(self.device):
                build_compiled_metrics(self.model, batch)

    def update(
        self, x: Any, y: Any, tower_predictions: list[Any], sample_weight: Any = None
    ) -> None:
        """Updates the compiled metrics with the towers' predictions, in tower order."""
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *tower_predictions
        )
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def track(
        self, loss: tf.Tensor, examples: Any, outputs: dict[str, tf.Tensor]
    ) -> None:
        """Adds a batch's loss to the tracker, weighted by its examples, and each
        output's (``outputs``; None: the model's ``compute_loss`` did) once a
        batch: Keras' per-output trackers count a batch of unknown size once."""
        self.loss_tracker.update_state(
            loss, sample_weight=tf.cast(examples, tf.float32)
        )
        trackers = output_loss_trackers(self.model) if outputs is not None else []
        names = [tracker.name.removesuffix("_loss") for tracker in trackers]
        if not set(names) <= set(outputs or ()) and len(names) == len(outputs):
            # Keras names the tracker of an output without a name after its
            # loss (a subclassed model's list of outputs): in output order.
            names = list(outputs)
        for tracker, name in zip(trackers, names):
            if name not in outputs:
                raise ValueError(
                    f"the model tracks the loss of an output {name!r} towers "
                    f"does not compute; received losses of {sorted(outputs)}"
                )
            tracker.update_state(outputs[name])

    def results(self) -> dict[str, tf.Tensor]:
        """``{name: value}`` of every metric of the model, the loss's first,
        as Keras' ``get_metrics_result`` gives them."""
        return self.model.get_metrics_result()

    def snapshot(self, tracker: bool = False) -> Changes:
        """Every metric variable's value now, the loss tracker's only with
        ``tracker`` (a model's own step updates it itself)."""
        skip = None if tracker else self.loss_tracker
        variables = [v for metric in self.model.metrics if metric is not skip
                     for v in metric.variables]  # fmt: skip
        return Changes(variables, [tf.convert_to_tensor(v) for v in variables])

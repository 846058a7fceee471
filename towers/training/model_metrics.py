"""What ``fit``, ``evaluate`` and callbacks read of the model's metrics.

The compiled model owns them (``towers/step/metrics.py``): ``Trainer`` reads,
resets and reports them as Keras' own trainer does.
"""

from __future__ import annotations

from typing import Any

import keras

from towers._keras import global_seed_kept, loss_tracker, pythonify_logs
from towers.training.compiling import require_compiled
from towers.training.fits import named_misfits


class ModelMetrics:
    """The model's metrics, for a trainer with a ``model`` (a Keras model),
    its ``step`` (``towers/step/step.py``) and ``prepare``."""

    model: keras.Model
    step: Any

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """The model's own metrics, as ``model.metrics`` lists them.

        >>> [m.name for m in make_engine(metrics=["mae"]).metrics]
        ['loss', 'compile_metrics']
        """
        return self.model.metrics

    @property
    def loss_tracker(self) -> keras.metrics.Metric:
        """The model's loss tracker: an epoch's loss so far.

        >>> make_engine().loss_tracker.name
        'loss'
        """
        return loss_tracker(self.model)

    def require_compiled(self, method: str) -> None:
        """Raises, as Keras' ``fit`` does, for a model not compiled (which
        only predicts; ``towers/training/compiling.py``).

        >>> make_engine().require_compiled("fit")  # compiled with its loss
        """
        require_compiled(self.model, f"Towers.{method}")

    def reset_metrics(self) -> None:
        """Starts every metric of the model afresh, the loss tracker's
        included, as Keras' ``model.reset_metrics`` (each epoch does).

        >>> eng = make_engine()
        >>> _ = eng.evaluate_step(np.zeros((4, 3), "f4"), np.ones((4, 1), "f4"))
        >>> eng.get_metrics_result()
        {'loss': 1.0}
        >>> eng.reset_metrics()
        >>> eng.get_metrics_result()
        {'loss': 0.0}
        """
        self.model.reset_metrics()

    def get_metrics_result(self) -> dict[str, Any]:
        """The loss's and every metric's current value, as Keras' callbacks
        see them (Python numbers; a metric with one value per class, such
        as ``F1Score``, as a NumPy array; in name order).

        >>> eng = make_engine(metrics=["mae"])
        >>> _ = eng.evaluate_step(np.zeros((4, 3), "f4"), np.ones((4, 1), "f4"))
        >>> eng.get_metrics_result()
        {'loss': 1.0, 'mae': 1.0}
        """
        return pythonify_logs(self.model.get_metrics_result())

    def build_metrics(
        self, x: Any, y: Any = None, sample_weight: Any = None, training=True
    ) -> None:
        """Before a first training (or evaluation) step: checks its targets
        against the loss and builds the compiled metrics from its shapes
        (``Step.build_metrics``); nothing is trained.

        >>> eng = make_engine(metrics=["mae"])
        >>> eng.build_metrics(np.ones((2, 3), "f4"), np.ones((2, 1), "f4"))
        >>> eng.model.metrics_names
        ['loss', 'compile_metrics']
        """
        with global_seed_kept():  # symbolic calls one device's fit does not make
            self.step.build_metrics(x, y, sample_weight, training)

    def _training_batch(self, method: str, *batch: Any) -> tuple:
        """A training or evaluation batch, prepared (``prepare``), with the
        model compiled, its metrics built and, before a first step, its loss
        terms probed (a term coupling the examples gathered or named, one
        summing them taken as a sum: ``towers/step/rules/coupled.py``)."""
        self.require_compiled(method)
        training = method != "evaluate_step"
        batch = self.prepare(*batch, kind="train" if training else "evaluate")
        with named_misfits(self.model, batch):
            self.build_metrics(*batch, training=training)
            with global_seed_kept():  # calls one device's fit does not make
                self.step.probe(*batch, training=training)
        return batch

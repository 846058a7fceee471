"""One tower's work: its forward pass, its share of the loss, and its gradients.

Every tower runs the same code on its own device (the step opens the device
scope); only the shard and, for a copy per tower, the model differ::

    x_t, y_t: the tower's n_t examples
      -> y_pred = model(x_t)
      -> loss_t = sum(per-example losses) / B  (+ regularisers * n_t / B)
      -> grads_t = d loss_t / d trainable variables        (training only)

Dividing by the whole step's B, not by n_t, is what lets the towers' gradients
simply add up to the full batch's: sum_t loss_t is the full-batch loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from towers.batchnorm import MovingStatistics
from towers.losses import TowerLoss
from towers.split import batch_size_of


@dataclasses.dataclass
class TowerResult:
    """What one tower hands back to the step.

    Attributes:
      loss: f32[], the tower's share of the full-batch loss (unscaled).
      predictions: the model's outputs on the tower's shard, ``[n_t, ...]``.
      grads: per trainable variable, a Tensor, IndexedSlices or None (no path
        from the loss); None in evaluation. Of ``scale * loss`` under loss
        scaling: the update unscales their combination once.
      moments: BatchNormalization moments by layer index (see
        ``towers/batchnorm.py``); empty in evaluation.
    """

    loss: tf.Tensor
    predictions: Any
    grads: list[Any] | None = None
    moments: dict[int, tuple] = dataclasses.field(default_factory=dict)


class Tower:
    """The work of one tower, the same on every device.

    Args:
      loss: the user's loss as per-example values and a global normaliser.
      moving_statistics: records each BatchNormalization layer's moments
        instead of letting every tower move the shared statistics.
      scale_loss: what the gradient sees of the loss (loss scaling, or identity).

    Example:
      >>> import keras, numpy as np
      >>> from towers.batchnorm import MovingStatistics
      >>> from towers.losses import TowerLoss
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> tower = Tower(TowerLoss("mse"), MovingStatistics(lambda: model), tf.identity)
      >>> x, y = np.zeros((3, 2), "float32"), np.ones((3, 1), "float32")
      >>> result = tower.train(model, x, y, normaliser=6)  # 3 of 6 examples
      >>> float(result.loss), len(result.grads)  # errors of 1: 3 * 1 / 6
      (0.5, 2)
    """

    def __init__(
        self,
        loss: TowerLoss,
        moving_statistics: MovingStatistics,
        scale_loss: Callable[[tf.Tensor], tf.Tensor],
    ):
        self.loss = loss
        self.moving_statistics = moving_statistics
        self.scale_loss = scale_loss

    def evaluate(
        self, model: keras.Model, x: Any, y: Any, normaliser: Any
    ) -> TowerResult:
        """The tower's predictions and loss share, in inference mode."""
        return self._forward(model, x, y, normaliser, training=False)

    def train(self, model: keras.Model, x: Any, y: Any, normaliser: Any) -> TowerResult:
        """The forward pass in training mode, then the gradients of its loss share.

        Args:
          model: the model this tower runs (shared, or the tower's copy).
          x, y: the tower's shard, ``[n_t, ...]``.
          normaliser: B, the step's examples (1 for an empty share).
        """
        with tf.GradientTape() as tape, self.moving_statistics.recording() as moments:
            result = self._forward(model, x, y, normaliser, training=True)
            scaled = self.scale_loss(result.loss)
        result.grads = tape.gradient(scaled, model.trainable_variables)
        result.moments = moments
        return result

    def _forward(self, model, x, y, normaliser, training: bool) -> TowerResult:
        y_pred = model(x, training=training)
        loss = self.loss.tower_loss(y, y_pred, normaliser)
        if model.losses:
            # Regularisers are per-batch means in Keras 3: weight by n_t / B so
            # the towers' shares add up to the full batch's one.
            share = tf.cast(batch_size_of(x), tf.float32) / tf.cast(
                normaliser, tf.float32
            )
            loss += tf.add_n(model.losses) * share
        return TowerResult(loss=loss, predictions=y_pred)

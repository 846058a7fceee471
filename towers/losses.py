"""Per-example losses and the one normaliser that makes T towers add up to one.

Each tower computes ``sum(per_example_t) / N`` where N is the *global* count the
user's reduction divides by (B for a per-example function, B * elements-per-example
for Keras's ``sum_over_batch_size``, 1 for ``sum``). Summing those over towers gives
exactly the loss one device computes on the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import keras
import numpy as np
import tensorflow as tf

# Keras reductions that divide the summed loss by the number of loss elements.
_MEAN_REDUCTIONS = (
    None,
    "none",
    "sum_over_batch_size",
    "mean",
    "mean_with_sample_weight",
)


class TowerLoss:
    """The user's loss as per-example values plus its global normaliser.

    Args:
      loss: a ``keras.losses.Loss`` (any reduction), the name of a Keras loss
        (``"mse"``), or a function ``f(y_true, y_pred)`` that returns one value per
        example, shape ``[B_t]``.

    Raises:
      ValueError: ``loss`` is none of those, or a Keras loss has an unknown reduction.
    """

    def __init__(self, loss: Any):
        self.name = getattr(loss, "name", None) or getattr(loss, "__name__", repr(loss))
        if isinstance(loss, str):
            loss = keras.losses.get(loss)
        if isinstance(loss, keras.losses.Loss):
            if loss.reduction not in (*_MEAN_REDUCTIONS, "sum"):
                raise ValueError(
                    f"unsupported loss reduction {loss.reduction!r} on {self.name}; "
                    f"expected one of {['sum', *_MEAN_REDUCTIONS]}"
                )
            self._sum = loss.reduction == "sum"
            # Same loss, same preprocessing, but give us the values unreduced.
            self._fn = copy.copy(loss)
            self._fn.reduction = None
            self._strict = False
        elif callable(loss):
            self._sum, self._fn, self._strict = False, loss, True
        else:
            raise ValueError(
                "loss must be a keras.losses.Loss, a Keras loss name, or a function "
                f"(y_true, y_pred) -> per-example losses; received {loss!r}"
            )

    @property
    def normalised_by_batch(self) -> bool:
        """Whether the loss divides by the batch size (every reduction but sum)."""
        return not self._sum

    def tower_loss(self, y_true: Any, y_pred: Any, global_batch: Any) -> tf.Tensor:
        """This tower's share of the full-batch loss (a float32 scalar).

        Args:
          y_true, y_pred: the tower's targets and predictions, ``[B_t, ...]``.
          global_batch: B, the examples in the whole step (int or scalar tensor).
        """
        values = self._fn(y_true, y_pred)
        values = tf.cast(values, tf.float32)  # values: f32[B_t, ...]
        values = self._check_per_example(values, y_pred)
        total = tf.reduce_sum(values)
        if self._sum:
            return total
        per_example = int(np.prod(values.shape[1:])) if values.shape.rank else 1
        return total / tf.cast(global_batch * per_example, tf.float32)

    def _check_per_example(self, values: tf.Tensor, y_pred: Any) -> tf.Tensor:
        tower_batch = _leading_dim(y_pred)
        rank_ok = values.shape.rank == 1 or (not self._strict and values.shape.rank)
        if values.shape.rank is not None and not rank_ok:
            raise ValueError(
                f"loss {self.name} must return one value per example, shape "
                f"[{tower_batch}]; received shape {values.shape}. Return per-example "
                "losses (e.g. a Keras loss with reduction=None), not their mean."
            )
        if isinstance(tower_batch, int) and values.shape[0] is not None:
            if values.shape[0] != tower_batch:
                raise ValueError(
                    f"loss {self.name} must return one value per example: "
                    f"{tower_batch} predictions gave {values.shape[0]} loss values"
                )
            return values
        check = tf.debugging.assert_equal(
            tf.shape(values)[0],
            tf.shape(tf.nest.flatten(y_pred)[0])[0],
            message=f"loss {self.name} must return one value per example",
        )
        with tf.control_dependencies([check]):
            return tf.identity(values)


def _leading_dim(nest: Any) -> int | None:
    return tf.nest.flatten(nest)[0].shape[0]

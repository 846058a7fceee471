"""BatchNormalization's moving statistics under towers: one explicit policy.

In training, a BatchNormalization layer normalises each tower's shard with that
shard's own mean and variance (as tf_cnn_benchmarks and MirroredStrategy do) and
then moves its ``moving_mean`` / ``moving_variance`` toward them. Left alone, every
tower would assign the shared moving variables in turn, each on top of the last:
the result would depend on T and chain the towers one after another. Towers instead
keeps each tower's moments, and after the step updates each moving statistic once,
with Keras' own rule ``moving = moving * momentum + stat * (1 - momentum)``, where
``stat`` is chosen by the policy:

- ``"batch"`` (default): the whole batch's mean and variance, combined exactly from
  the towers' moments (weighted by their example counts, the variance including the
  spread between tower means). The moving statistics are what one device would get
  from the same layer inputs.
- ``"tower0"``: tower 0's moments only (tf_cnn_benchmarks' choice).
- ``"mean"``: the unweighted mean over towers of their means and of their variances
  (what MirroredStrategy's MEAN-aggregated assignment gives).

The update runs with the optimizer's apply, so a skipped step leaves the moving
statistics unchanged too. It is the one place towers and one device differ: the
normalisation itself uses each shard's statistics, so with BatchNormalization the
gradients are not the full batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import keras
import tensorflow as tf

MovingStatisticsPolicy = Literal["batch", "tower0", "mean"]
POLICIES = ("batch", "tower0", "mean")


class MovingStatistics:
    """Collects each tower's BatchNormalization moments and applies one update.

    Args:
      model: a zero-arg function returning the engine's model (it is asked on
        each use: a balanced placement rebuilds a lazily built model); every
        BatchNormalization layer in it (nested ones included) is handled.
      policy: ``"batch"``, ``"tower0"`` or ``"mean"`` (see the module docstring).

    Raises:
      ValueError: an unknown policy, or a layer with ``renorm=True`` (its moving
        statistics follow a different rule).

    Example:
      >>> import keras
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3),
      ...                           keras.layers.BatchNormalization(name="bn")])
      >>> [layer.name for layer in MovingStatistics(lambda: model).layers]
      ['bn']
    """

    def __init__(
        self,
        model: Callable[[], keras.Model],
        policy: MovingStatisticsPolicy = "batch",
    ):
        if policy not in POLICIES:
            raise ValueError(
                f"moving_statistics must be one of {list(POLICIES)}; "
                f"received {policy!r}"
            )
        self.policy = policy
        self._model = model
        for layer in self.layers:
            if layer.renorm:
                raise ValueError(
                    "BatchNormalization with renorm=True is not supported under "
                    f"towers; received layer {layer.name!r} with renorm=True"
                )

    @property
    def layers(self) -> list[keras.layers.BatchNormalization]:
        """The model's BatchNormalization layers, nested ones included."""
        return [
            layer
            for layer in self._model()._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)
        ]

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict]:
        """Within, BatchNormalization layers record their moments, assign nothing.

        Yields:
          ``{layer index: (mean, variance, count)}``, filled as the layers run in
          training mode; ``count`` is the number of values each mean was taken over.
        """
        moments: dict[int, tuple] = {}
        patched = []
        try:
            for index, layer in enumerate(self.layers):
                _patch(layer, index, moments, self.policy)
                patched.append(layer)
            yield moments
        finally:
            for layer in patched:
                _unpatch(layer)

    def update(self, tower_moments: list[dict]) -> None:
        """Assigns every moving statistic once, as the policy says.

        Args:
          tower_moments: per working tower, in tower order, what ``recording``
            yielded for it.
        """
        for index, layer in enumerate(self.layers):
            per_tower = [m[index] for m in tower_moments if index in m]
            if not per_tower:
                continue  # the layer did not run in training mode
            mean, variance = self._statistics(per_tower)
            momentum = layer.momentum
            for moving, stat in [
                (layer.moving_mean, mean),
                (layer.moving_variance, variance),
            ]:
                stat = tf.cast(stat, moving.dtype)
                moving.assign(moving * momentum + stat * (1.0 - momentum))

    def _statistics(self, per_tower: list[tuple]) -> tuple[tf.Tensor, tf.Tensor]:
        means = [mean for mean, _, _ in per_tower]
        variances = [variance for _, variance, _ in per_tower]
        if self.policy == "tower0":
            return means[0], variances[0]
        if self.policy == "mean":
            return tf.add_n(means) / len(means), tf.add_n(variances) / len(variances)
        # "batch": weights n_t / n; variance = E[var_t] + E[(mean_t - mean)^2].
        counts = [count for _, _, count in per_tower]
        total = tf.add_n(counts)
        mean = tf.add_n([c * m for c, m in zip(counts, means)]) / total
        variance = (
            tf.add_n(
                [
                    c * (v + tf.square(m - mean))
                    for c, m, v in zip(counts, means, variances)
                ]
            )
            / total
        )
        return mean, variance


def _patch(layer, index: int, moments: dict, policy: str) -> None:
    """Makes ``layer`` record its moments and leave its moving variables alone."""
    moments_fn = layer._moments

    def recorded_moments(inputs, mask):
        if mask is not None and policy == "batch":
            raise ValueError(
                f"moving_statistics='batch' needs unmasked inputs; received a mask "
                f"in layer {layer.name!r}. Use 'tower0' or 'mean'."
            )
        if index in moments:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} ran twice in one tower's "
                "step; towers updates each layer's moving statistics once per step"
            )
        mean, variance = moments_fn(inputs, mask)
        # The number of values each channel's mean was taken over (n_t * H * W).
        count = tf.cast(tf.size(inputs), tf.float32) / tf.cast(
            tf.size(mean), tf.float32
        )
        moments[index] = (mean, variance, count)
        return mean, variance

    # Instance attributes shadow the class's methods for this trace only.
    object.__setattr__(layer, "_moments", recorded_moments)
    for moving in (layer.moving_mean, layer.moving_variance):
        object.__setattr__(moving, "assign", _skip_assign)


def _unpatch(layer) -> None:
    for obj, name in [
        (layer, "_moments"),
        (layer.moving_mean, "assign"),
        (layer.moving_variance, "assign"),
    ]:
        if name in vars(obj):
            object.__delattr__(obj, name)


def _skip_assign(value):
    """The tower's own moving-statistic assignment: dropped, the update is ours."""
    return value

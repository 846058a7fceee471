"""BatchNormalization under towers: what each tower normalises with, and its
moving statistics moved once a step (docs/batch-statistics.md).

``batch_statistics="tower"`` normalises each shard with its own moments
(MirroredStrategy's way); ``"global"`` with the whole batch's, the towers
meeting at every layer (``batch_moments.py``). Each tower's moments are
recorded and each statistic moves once by Keras' rule toward the policy's:
``"batch"`` the whole batch's, ``"tower0"`` tower 0's, ``"mean"`` the
towers' mean; with the apply, so a skipped step leaves them. In a model's
own step each call is a meeting where the first tower moves them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import keras
import tensorflow as tf

from towers._keras import layers_of, patches
from towers._keras.current import setting, this_tower
from towers.step.rules import places
from towers.step.rules.batch_moments import (
    batch_moments,
    count_of,
    global_moments,
    kept_values,
)
from towers.step.run import seats

MovingStatisticsPolicy = Literal["batch", "tower0", "mean"]
POLICIES = ("batch", "tower0", "mean")
BatchStatistics = Literal["tower", "global"]
BATCH_STATISTICS = ("tower", "global")


class MovingStatistics:
    """Collects each tower's BatchNormalization moments and applies one update.

    Args:
      model: a zero-arg function returning the engine's model (asked on each
        use: a balanced placement rebuilds a lazily built model).
      policy: ``"batch"``, ``"tower0"`` or ``"mean"``.
      statistics: what the towers normalise with, ``"tower"`` or ``"global"``.

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
        statistics: BatchStatistics = "global",
    ):
        for name, value, allowed in [
            ("moving_statistics", policy, POLICIES),
            ("batch_statistics", statistics, BATCH_STATISTICS),
        ]:
            if value not in allowed:
                raise ValueError(
                    f"{name} must be one of {list(allowed)}; received {value!r}"
                )
        self.policy, self.statistics = policy, statistics
        self._model = model
        self._patch = patches.Patch(
            lambda: [
                replacement
                for index, layer in enumerate(self.layers)
                for replacement in patches.batch_norm_replacements(
                    layer, self._recorded_moments(layer, index)
                )
            ]
        )
        self._epsilons: dict[int, float] = {}  # by layer: Keras' ε of its moments

    def whole_batch(self, layer: keras.layers.Layer) -> bool:
        """Whether ``layer`` normalises with the whole batch's moments (``"global"``,
        or its own ``synchronized=True``)."""
        return self.statistics == "global" or layer.synchronized

    @property
    def meets(self) -> bool:
        """Whether the towers meet at some layer's moments."""
        return any(self.whole_batch(layer) for layer in self.layers)

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
        """Within, the layers record their moments and assign nothing; yields
        ``{layer index: [(mean, variance, count) a call]}``."""
        moments: dict[int, tuple] = {}
        with self._patched(moments):
            yield moments

    @contextlib.contextmanager
    def moving_at_once(self, device: Any) -> Iterator[None]:
        """Within (a model's own step), each call of a layer in training mode is a
        meeting where the first tower moves its statistics on ``device``: two
        calls move them twice, as one device would, and the next call reads them."""
        with self._patched(device):
            yield

    @contextlib.contextmanager
    def _patched(self, record: Any) -> Iterator[None]:
        """Within, this thread's tower records its moments in ``record`` (a
        dict), or moves the statistics at once on ``record`` (a device)."""
        recording = {**this_tower().moments, id(self): record}
        with self._patch.applied(), setting(moments=recording):
            yield  # (towers in lockstep record at one time)

    def _recorded_moments(self, layer, index: int) -> Callable:
        """``layer``'s moments, recorded into the recording tower's dict (or
        moved at once), its moving variables left alone."""
        moments_fn = patches.own_moments(layer)

        def recorded_moments(inputs, mask):
            moments = this_tower().moments.get(id(self))
            kept = None if mask is None else kept_values(inputs, mask)
            # A masked layer divides by its count plus ε (Keras' _moments).
            self._epsilons[index] = 0.0 if kept is None else keras.config.epsilon()
            # Over the towers its seat meets; a tower with the whole batch
            # takes Keras' own, one device's.
            if self.whole_batch(layer) and not places.has_whole_batch():
                taken = global_moments(layer, inputs, kept)
            else:
                mean, variance = moments_fn(inputs, mask)
                taken = (mean, variance, count_of(layer, inputs, kept, mean))
            if not isinstance(moments, dict):  # a device: move them at once
                self._move_at_once(layer, index, taken, moments)
                return taken[:2]
            moments.setdefault(index, []).append(taken)  # a call each
            return taken[:2]

        return recorded_moments

    def update(self, tower_moments: list[dict]) -> None:
        """Assigns every moving statistic once, from each working tower's recorded
        moments (in tower order)."""
        for index, layer in enumerate(self.layers):
            per_tower = [m[index] for m in tower_moments if index in m]
            # Each call in training mode moves them, in call order (Keras').
            for calls in zip(*per_tower):
                stat = self._statistics(list(calls), self._epsilons[index], layer)
                _move(layer, *stat)

    def _move_at_once(self, layer, index: int, moments: tuple, device: Any) -> None:
        """Hands this tower's ``moments`` to the others; the first tower moves
        ``layer``'s statistics from every tower's."""
        epsilon = self._epsilons[index]

        def move(handed: list) -> None:
            with tf.device(device), tf.name_scope("moving_statistics/"):
                _move(layer, *self._statistics(handed, epsilon, layer))

        moments = tf.nest.map_structure(tf.stop_gradient, moments)
        moving = None if layer.renorm else [layer.moving_mean, layer.moving_variance]
        seats.current().once(moments, move, moving)  # renorm's: any

    def _statistics(
        self, per_tower: list[tuple], epsilon: float, layer: keras.layers.Layer
    ) -> tuple[tf.Tensor, tf.Tensor]:
        # The stat the policy takes from the towers' (mean, variance, count),
        # stacked: a few ops a layer whatever T (ops per tower grow the trace).
        if self.policy == "tower0" or len(per_tower) == 1:
            return per_tower[0][0], per_tower[0][1]
        if self.whole_batch(layer) and self.policy == "batch":
            # Every tower holds the whole batch's moments already.
            return per_tower[0][0], per_tower[0][1]
        means = tf.stack([mean for mean, _, _ in per_tower])
        variances = tf.stack([variance for _, variance, _ in per_tower])
        if self.policy == "mean":
            return tf.reduce_mean(means, 0), tf.reduce_mean(variances, 0)
        counts = tf.stack([count for _, _, count in per_tower])
        if counts.shape.rank < means.shape.rank:  # a count per tower: no mask
            counts = tf.reshape(counts, [-1] + [1] * (means.shape.rank - 1))
        return batch_moments(means, variances, counts, epsilon)


def _move(layer, mean: Any, variance: Any) -> None:
    # Keras' rule (a renorm layer's own method), past the layer's own
    # assignments that recording drops.
    if layer.renorm:
        patches.move_renorm(layer, mean, variance)
        return
    momentum = layer.momentum
    for moving, stat in [(layer.moving_mean, mean), (layer.moving_variance, variance)]:
        value = moving * momentum + tf.cast(stat, moving.dtype) * (1.0 - momentum)
        patches.assign(moving, value)


class Steady:
    """BatchNormalization normalising every part with its moving moments, as the
    towers share one batch's under global statistics: the two examples' own
    moments amplify a deep float32 network's rounding past any tolerance
    (MobileNetV2: 2.85 on two examples, 3.31 and 3.82 alone)."""

    def __init__(self, model: keras.Model):
        normalising = keras.layers.BatchNormalization
        self.layers = [x for x in layers_of(model) if isinstance(x, normalising)]

    def patched(self) -> Any:
        replaced = patches.batch_norm_replacements
        return patches.Patch(
            lambda: [r for layer in self.layers
                     for r in replaced(layer, moving_moments(layer))]
        ).applied()  # fmt: skip


def moving_moments(layer: keras.layers.Layer) -> Any:
    """A BatchNormalization ``layer``'s moments: its moving ones, shaped as
    its own."""
    own = patches.own_moments(layer)

    def moments(inputs: Any, mask: Any) -> Any:
        shaped = own(inputs, mask)
        return [
            tf.reshape(tf.cast(moving, m.dtype), tf.shape(m))
            for moving, m in zip((layer.moving_mean, layer.moving_variance), shaped)
        ]

    return moments

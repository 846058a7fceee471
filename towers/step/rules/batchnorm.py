"""BatchNormalization under towers: what each tower normalises with, and its
moving statistics moved once a step (docs/batch-statistics.md).

``batch_statistics``: ``"tower"`` normalises each shard with its own moments
(MirroredStrategy's way, not one device's gradients); ``"global"`` with the
whole batch's, the towers meeting at every layer by sums (cut into phases,
``phases.py``, or in lockstep), forward and backward, as one device.

The moving statistics: each tower's moments are recorded, and after the step
each statistic moves once by Keras' rule toward the policy's stat:
``"batch"`` the whole batch's (count-weighted, masks included), ``"tower0"``
tower 0's, ``"mean"`` the towers' unweighted mean. They move with the apply,
so a skipped step leaves them too. In a model's own step every call in
training mode is a meeting where the first tower moves them at once
(:meth:`MovingStatistics.moving_at_once`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import keras
import tensorflow as tf

from towers._keras import layers_of, patches
from towers._keras.current import setting, this_tower
from towers.step.run import seats

MovingStatisticsPolicy = Literal["batch", "tower0", "mean"]
POLICIES = ("batch", "tower0", "mean")
BatchStatistics = Literal["tower", "global"]
BATCH_STATISTICS = ("tower", "global")


class MovingStatistics:
    """Collects each tower's BatchNormalization moments and applies one update.

    Args:
      model: a zero-arg function returning the engine's model (it is asked on
        each use: a balanced placement rebuilds a lazily built model); every
        BatchNormalization layer in it (nested ones included) is handled.
      policy: ``"batch"``, ``"tower0"`` or ``"mean"`` (see the module docstring).
      statistics: what the towers normalise with, ``"tower"`` or ``"global"``.

    Raises:
      ValueError: an unknown policy or statistics.

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

    def whole_batch(self, layer: Any) -> bool:
        """Whether ``layer`` normalises with the whole batch's moments: under
        ``"global"``, or asked by the layer itself (``synchronized=True``,
        as under a tf.distribute strategy)."""
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
        """Within, BatchNormalization layers record their moments, assign nothing.

        Yields:
          ``{layer index: [(mean, variance, count), ...]}``, a tuple a call
          in training mode; ``count``: the values each mean was taken over.
        """
        moments: dict[int, tuple] = {}
        with self._patched(moments):
            yield moments

    @contextlib.contextmanager
    def moving_at_once(self, device: Any) -> Iterator[None]:
        """Within (a tower's thread in lockstep, ``towers/step/run/turns.py``),
        every call of a layer in training mode is a meeting: the towers hand
        in their moments, and the first moves the layer's moving statistics
        at once, as the policy says, on ``device``. So a model's own step that
        calls a layer twice moves them twice, in the order one device would,
        and a read after a move (the layer's next call) sees it."""
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
            kept = None if mask is None else _kept(inputs, mask)
            # A masked layer divides by its count plus ε (Keras' _moments).
            self._epsilons[index] = 0.0 if kept is None else keras.config.epsilon()
            if self.whole_batch(layer):  # over the towers its seat meets
                taken = _global_moments(layer, inputs, kept)
            else:
                mean, variance = moments_fn(inputs, mask)
                taken = (mean, variance, _count(layer, inputs, kept, mean))
            if not isinstance(moments, dict):  # a device: move them at once
                self._move_at_once(layer, index, taken, moments)
                return taken[:2]
            moments.setdefault(index, []).append(taken)  # a call each
            return taken[:2]

        return recorded_moments

    def update(self, tower_moments: list[dict]) -> None:
        """Assigns every moving statistic once, as the policy says.

        Args:
          tower_moments: per working tower, in tower order, what ``recording``
            yielded for it (every tower calls each layer as often).
        """
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
        self, per_tower: list[tuple], epsilon: float, layer: Any
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The ``stat`` the policy takes from the towers' ``(mean, variance,
        count)``, each as Keras' ``_moments`` gives it (``epsilon`` added to
        the count of a masked layer's). The towers' moments are stacked, so a
        layer's update is a few ops whatever the number of towers (a graph of
        ops per tower grows the trace and TensorFlow's optimisation of the step
        with T)."""
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
        return _batch_moments(means, variances, counts, epsilon)


def _batch_moments(means: Any, variances: Any, counts: Any, epsilon: float) -> tuple:
    """The whole batch's moments from the towers' ``[T, C]`` moments and counts:
    weights n_t / n, variance = E[var_t] + E[(mean_t - mean)^2]. Keras divides a
    masked layer's sums by the count plus ``epsilon``: the towers' moments are
    first made plain (divided by the count alone), and ε put back on the batch's.
    A tower whose values are all masked weighs nothing."""
    # Without a mask every tower that runs has values: no count is 0.
    divide = tf.math.divide_no_nan if epsilon else tf.math.divide
    if epsilon:
        plain = means * divide(counts + epsilon, counts)
        variances = variances * divide(counts + epsilon, counts)
        variances -= tf.math.squared_difference(plain, means)
        means = plain
    total = tf.reduce_sum(counts, 0)
    mean = divide(tf.reduce_sum(counts * means, 0), total)
    spread = variances + tf.math.squared_difference(means, mean)
    variance = divide(tf.reduce_sum(counts * spread, 0), total)
    if not epsilon:
        return mean, variance
    # Keras' mean S / (n + ε), and its mean squared distance from that mean.
    kept = mean * total / (total + epsilon)
    return kept, total * (variance + tf.square(mean - kept)) / (total + epsilon)


def _move(layer, mean: Any, variance: Any) -> None:
    """Keras' rule, ``moving = moving * momentum + stat * (1 - momentum)`` (a
    renorm layer's own method, which moves its renorm statistics too), past
    the layer's own assignments that recording drops."""
    if layer.renorm:
        patches.move_renorm(layer, mean, variance)
        return
    momentum = layer.momentum
    for moving, stat in [(layer.moving_mean, mean), (layer.moving_variance, variance)]:
        value = moving * momentum + tf.cast(stat, moving.dtype) * (1.0 - momentum)
        patches.assign(moving, value)


def _kept(inputs: tf.Tensor, mask: Any) -> tf.Tensor:
    """Where ``inputs`` count, as Keras' ``_moments`` reads a layer's mask: the
    mask broadcast over the last axis."""
    mask = tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs))
    return tf.cast(mask, tf.bool)


def _count(layer, inputs: tf.Tensor, kept: Any, mean: tf.Tensor) -> tf.Tensor:
    """The number of values each channel's mean was taken over (n_t * H * W, or
    the unmasked ones), in the mean's dtype."""
    if kept is None:
        size = tf.cast(tf.size(inputs), mean.dtype)
        return size / tf.cast(tf.size(mean), mean.dtype)
    weights = tf.cast(kept, mean.dtype)
    return tf.squeeze(
        tf.reduce_sum(weights, patches.reduction_axes(layer), keepdims=True)
    )


def _global_moments(layer, inputs: tf.Tensor, kept: Any) -> tuple:
    """The whole batch's mean and variance of ``layer``'s inputs over the towers
    in lockstep, as Keras' ``_moments`` takes them on one device: the mean first,
    then the mean squared distance from it; and the count they were taken over.
    In the inputs' dtype: Keras has already cast 16-bit inputs to float32, and
    a float64 model keeps float64. Shaped as Keras' moments (the reduced axes
    dropped; every axis of one, with a mask)."""
    axes = patches.reduction_axes(layer)
    epsilon = 0.0 if kept is None else keras.config.epsilon()
    mean, variance, count = _moments_over_towers(inputs, axes, kept, epsilon)
    if kept is None:  # one count: a scalar
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes), count
    return tf.squeeze(mean), tf.squeeze(variance), tf.squeeze(count)


def _moments_over_towers(x: tf.Tensor, axes: list[int], kept: Any, epsilon: float):
    """``(mean, variance, count)`` of ``x`` over every tower's shard (the values
    ``kept`` says count, if given), the reduced axes kept (so they broadcast
    against ``x`` whatever the layer's axis); the sums are divided by the count
    plus ``epsilon``, as Keras does a masked layer's.

    Forward, two exchanges: the sums with the counts riding along, then the
    squared distances from the mean. Backward, one: every tower's gradients
    with respect to the mean and the variance, summed over the towers (every
    tower's loss depends on them); then this tower's inputs take one device's
    gradient, ``d mean / dx = 1 / (N + ε)`` and ``d variance / dx = 2 (x -
    mean) / (N + ε)``, plus the mean's part of the latter, ``-2 ε mean / (N +
    ε)`` times the former (zero without ε). Across workers each exchange is a
    round of RPCs, so fewer is faster.
    """

    def only_kept(values: tf.Tensor) -> tf.Tensor:
        return values if kept is None else tf.where(kept, values, tf.zeros([], x.dtype))

    @tf.custom_gradient
    def moments(x: tf.Tensor):
        local_sum = tf.reduce_sum(only_kept(x), axes, keepdims=True)
        if kept is None:  # the count rides along: one per tower
            count = _count(None, x, None, local_sum)
            packed = tf.concat([tf.reshape(local_sum, [-1]), [count]], 0)
            summed = seats.total(packed)
            total, count = tf.reshape(summed[:-1], tf.shape(local_sum)), summed[-1]
        else:  # a count per channel
            count = tf.reduce_sum(tf.cast(kept, x.dtype), axes, keepdims=True)
            total, count = tf.unstack(seats.total(tf.stack([local_sum, count])))
        denominator = count + epsilon if epsilon else count
        mean = total / denominator
        centred = only_kept(x - mean)
        squares = tf.reduce_sum(tf.square(centred), axes, keepdims=True)
        variance = seats.total(squares) / denominator

        def gradient(d_mean: Any, d_variance: Any, _: Any) -> tf.Tensor:
            upstream = [
                tf.zeros_like(mean) if d is None else d for d in (d_mean, d_variance)
            ]
            d_mean, d_variance = tf.unstack(
                seats.total(tf.stack(upstream), backward=True)
            )
            if epsilon:
                d_mean -= 2.0 * epsilon * mean * d_variance / denominator
            return (only_kept(d_mean) + 2.0 * d_variance * centred) / denominator

        return (mean, variance, count), gradient  # the count takes no gradient

    return moments(x)


class Steady:
    """BatchNormalization normalising every part with its moving moments:
    the same moments for each part, as the towers share the whole batch's
    under global statistics, so no example reads another through them. (The
    two examples' own moments would serve in exact arithmetic, but a deep
    float32 network amplifies the rounding between a batch of one and of two
    through them past any tolerance: MobileNetV2 read 2.85 on two examples
    and 3.31 and 3.82 alone.)"""

    def __init__(self, model: keras.Model):
        normalising = keras.layers.BatchNormalization
        self.layers = [x for x in layers_of(model) if isinstance(x, normalising)]

    def patched(self) -> Any:
        replaced = patches.batch_norm_replacements
        return patches.Patch(
            lambda: [r for layer in self.layers
                     for r in replaced(layer, moving_moments(layer))]
        ).applied()  # fmt: skip


def moving_moments(layer: Any) -> Any:
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

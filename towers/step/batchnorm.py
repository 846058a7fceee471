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
statistics unchanged too. A model's own ``train_step`` (``towers/step/custom.py``)
may call a layer more than once a step, each call moving the statistics on one
device: there every call in training mode is a meeting, where the first tower
moves them at once by the same policy (``moving_at_once``).

What each tower normalises with is ``batch_statistics``:

- ``"tower"`` (default): its own shard's mean and variance, as tf_cnn_benchmarks
  and MirroredStrategy do. The gradients are then not the full batch's.
- ``"global"``: the whole batch's, count-weighted over the towers that have
  examples, with the backward pass flowing through them as on one device: the
  towers meet at every layer, so a BatchNormalization model trains to one
  device's weights and moving statistics. The tower's pass is traced once and
  cut at those meetings into phases (with XLA, XLA computations:
  ``towers/step/segments.py``); a pass that cannot be cut is traced tower by
  tower in lockstep (``towers/step/lockstep.py``). Every policy above then
  moves them toward the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import keras
import tensorflow as tf

from towers.step import meetings

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
      ValueError: an unknown policy or statistics, a layer with ``renorm=True``
        (its moving statistics follow a different rule), or one with
        ``synchronized=True`` under ``"tower"`` (Keras would silently take each
        tower's statistics).

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
        statistics: BatchStatistics = "tower",
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
        self._lock, self._users = threading.Lock(), 0
        self._local = threading.local()  # the recording tower's moments
        for layer in self.layers:
            if layer.renorm:
                raise ValueError(
                    "BatchNormalization with renorm=True is not supported under "
                    f"towers; received layer {layer.name!r} with renorm=True"
                )
            if layer.synchronized and statistics == "tower":
                raise ValueError(
                    f"layer {layer.name!r} has synchronized=True, which under towers "
                    "would normalise with each tower's statistics; pass "
                    "batch_statistics='global' to Towers for the whole batch's"
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
        with self._patched(moments):
            yield moments

    @contextlib.contextmanager
    def moving_at_once(self, device: Any) -> Iterator[None]:
        """Within (a tower's thread in lockstep, ``towers/step/lockstep.py``),
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
        with self._lock:  # towers traced in lockstep record at the same time
            if not self._users:
                for index, layer in enumerate(self.layers):
                    self._patch(layer, index)
            self._users += 1
        self._local.moments = record
        try:
            yield
        finally:
            self._local.moments = None
            with self._lock:
                self._users -= 1
                if not self._users:
                    for layer in self.layers:
                        _unpatch(layer)

    def _patch(self, layer, index: int) -> None:
        """Makes ``layer`` record its moments into the recording tower's dict
        and leave its moving variables alone."""
        moments_fn = layer._moments

        def recorded_moments(inputs, mask):
            moments = self._local.moments
            if mask is not None and (
                self.policy == "batch" or self.statistics == "global"
            ):
                raise ValueError(
                    f"moving_statistics='batch' and batch_statistics='global' need "
                    f"unmasked inputs; received a mask in layer {layer.name!r}"
                )
            if isinstance(moments, dict) and index in moments:
                raise ValueError(
                    f"BatchNormalization layer {layer.name!r} ran twice in one "
                    "tower's step; towers updates each layer's moving statistics "
                    "once per step"
                )
            if self.statistics == "global" and meetings.current() is not None:
                taken = _global_moments(layer, inputs)
            else:
                mean, variance = moments_fn(inputs, mask)
                taken = (mean, variance, _count(inputs, mean))
            if not isinstance(moments, dict):  # a device: move them at once
                self._move_at_once(layer, taken, moments)
                return taken[:2]
            moments[index] = taken
            return taken[:2]

        # Instance attributes shadow the class's methods while recording.
        object.__setattr__(layer, "_moments", recorded_moments)
        for moving in (layer.moving_mean, layer.moving_variance):
            object.__setattr__(moving, "assign", _skip_assign)

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
            _move(layer, *self._statistics(per_tower))

    def _move_at_once(self, layer, moments: tuple, device: Any) -> None:
        """Hands this tower's ``moments`` to the others; the first tower moves
        ``layer``'s statistics from every tower's."""
        seat = meetings.current()
        handed = seat.everyone(tf.nest.map_structure(tf.stop_gradient, moments))
        if seat.first:
            with tf.device(device), tf.name_scope("moving_statistics/"):
                _move(layer, *self._statistics(handed), patched=True)

    def _statistics(self, per_tower: list[tuple]) -> tuple[tf.Tensor, tf.Tensor]:
        """The ``stat`` the policy takes from the towers' ``(mean, variance,
        count)``. The towers' moments are stacked, so a layer's update is a few
        ops whatever the number of towers (a graph of ops per tower grows the
        trace and TensorFlow's optimisation of the step with T)."""
        if self.policy == "tower0" or len(per_tower) == 1:
            return per_tower[0][0], per_tower[0][1]
        if self.statistics == "global" and self.policy == "batch":
            # Every tower holds the whole batch's moments already.
            return per_tower[0][0], per_tower[0][1]
        means = tf.stack([mean for mean, _, _ in per_tower])
        variances = tf.stack([variance for _, variance, _ in per_tower])
        if self.policy == "mean":
            return tf.reduce_mean(means, 0), tf.reduce_mean(variances, 0)
        # "batch": weights n_t / n; variance = E[var_t] + E[(mean_t - mean)^2].
        counts = tf.stack([count for _, _, count in per_tower])
        counts = tf.reshape(counts, [-1] + [1] * (len(means.shape) - 1))
        total = tf.reduce_sum(counts, 0)
        mean = tf.reduce_sum(counts * means, 0) / total
        spread = variances + tf.math.squared_difference(means, mean)
        return mean, tf.reduce_sum(counts * spread, 0) / total


def _move(layer, mean: Any, variance: Any, patched: bool = False) -> None:
    """Keras' rule, ``moving = moving * momentum + stat * (1 - momentum)``;
    ``patched``: the layer's own assignments are dropped (``_skip_assign``),
    so the variable's class assigns."""
    momentum = layer.momentum
    for moving, stat in [(layer.moving_mean, mean), (layer.moving_variance, variance)]:
        value = moving * momentum + tf.cast(stat, moving.dtype) * (1.0 - momentum)
        assign = functools.partial(type(moving).assign, moving)
        (assign if patched else moving.assign)(value)


def _count(inputs: tf.Tensor, mean: tf.Tensor) -> tf.Tensor:
    """The number of values each channel's mean was taken over (n_t * H * W), in
    the mean's dtype."""
    return tf.cast(tf.size(inputs), mean.dtype) / tf.cast(tf.size(mean), mean.dtype)


def _global_moments(layer, inputs: tf.Tensor) -> tuple:
    """The whole batch's mean and variance of ``layer``'s inputs over the towers
    in lockstep, as ``tf.nn.moments`` takes them on one device: the mean first,
    then the mean squared distance from it; and the count they were taken over.
    In the inputs' dtype: Keras has already cast 16-bit inputs to float32, and
    a float64 model keeps float64. Shaped as Keras' moments (the reduced axes
    dropped)."""
    axes = layer._reduction_axes
    mean, variance, count = _moments_over_towers(inputs, axes)
    return tf.squeeze(mean, axes), tf.squeeze(variance, axes), count


def _moments_over_towers(x: tf.Tensor, axes: list[int]) -> tuple:
    """``(mean, variance, count)`` of ``x`` over every tower's shard, the reduced
    axes kept (so they broadcast against ``x`` whatever the layer's axis).

    Forward, two exchanges: the sums with the count riding along, then the
    squared distances from the mean. Backward, one: every tower's gradients
    with respect to the mean and the variance, summed over the towers (every
    tower's loss depends on them); then this tower's inputs take one device's
    gradient, ``d mean / dx = 1 / N`` and ``d variance / dx = 2 (x - mean) / N``
    (the mean's part of the latter sums to zero). Across workers each exchange
    is a round of RPCs, so fewer is faster.
    """

    @tf.custom_gradient
    def moments(x: tf.Tensor):
        local_sum = tf.reduce_sum(x, axes, keepdims=True)
        packed = tf.concat([tf.reshape(local_sum, [-1]), [_count(x, local_sum)]], 0)
        summed = meetings.total(packed)
        count = summed[-1]
        mean = tf.reshape(summed[:-1], tf.shape(local_sum)) / count
        centred = x - mean
        squares = tf.reduce_sum(tf.square(centred), axes, keepdims=True)
        variance = meetings.total(squares) / count

        def gradient(d_mean: Any, d_variance: Any, _: Any) -> tf.Tensor:
            upstream = [
                tf.zeros_like(mean) if d is None else d for d in (d_mean, d_variance)
            ]
            both = tf.concat([tf.reshape(d, [-1]) for d in upstream], 0)
            d_mean, d_variance = [
                tf.reshape(d, tf.shape(mean))
                for d in tf.split(meetings.total(both, backward=True), 2)
            ]
            return (d_mean + 2.0 * d_variance * centred) / count

        return (mean, variance, count), gradient  # the count takes no gradient

    return moments(x)


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

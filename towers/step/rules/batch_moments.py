"""BatchNormalization's moments over the towers: the whole batch's mean
and variance of a layer's inputs as one device takes them (``"global"``
batch statistics, ``synchronized=True``), and the whole batch's moments
from the towers' own (the moving statistics' ``"batch"`` policy); a masked
layer's counts as Keras' ``_moments`` reads them.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers._keras import patches
from towers.step.run import seats


def kept_values(inputs: tf.Tensor, mask: Any) -> tf.Tensor:
    """Where ``inputs`` count, as Keras' ``_moments`` reads a layer's mask: the
    mask broadcast over the last axis."""
    mask = tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs))
    return tf.cast(mask, tf.bool)


def count_of(layer, inputs: tf.Tensor, kept: Any, mean: tf.Tensor) -> tf.Tensor:
    """The number of values each channel's mean was taken over (n_t * H * W, or
    the unmasked ones), in the mean's dtype."""
    if kept is None:
        size = tf.cast(tf.size(inputs), mean.dtype)
        return size / tf.cast(tf.size(mean), mean.dtype)
    weights = tf.cast(kept, mean.dtype)
    return tf.squeeze(
        tf.reduce_sum(weights, patches.reduction_axes(layer), keepdims=True)
    )


def global_moments(layer, inputs: tf.Tensor, kept: Any) -> tuple:
    """The whole batch's mean and variance of ``layer``'s inputs over the towers
    in lockstep, as Keras' ``_moments`` takes them on one device: the mean first,
    then the mean squared distance from it; and the count they were taken over.
    In the inputs' dtype: Keras has already cast 16-bit inputs to float32, and
    a float64 model keeps float64. Shaped as Keras' moments (the reduced axes
    dropped; every axis of one, with a mask)."""
    axes = patches.reduction_axes(layer)
    epsilon = 0.0 if kept is None else keras.config.epsilon()
    mean, variance, count = moments_over_towers(inputs, axes, kept, epsilon)
    if kept is None:  # one count: a scalar
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes), count
    return tf.squeeze(mean), tf.squeeze(variance), tf.squeeze(count)


def moments_over_towers(x: tf.Tensor, axes: list[int], kept: Any, epsilon: float):
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

    def onlykept_values(values: tf.Tensor) -> tf.Tensor:
        return values if kept is None else tf.where(kept, values, tf.zeros([], x.dtype))

    @tf.custom_gradient
    def moments(x: tf.Tensor):
        local_sum = tf.reduce_sum(onlykept_values(x), axes, keepdims=True)
        if kept is None:  # the count rides along: one per tower
            count = count_of(None, x, None, local_sum)
            packed = tf.concat([tf.reshape(local_sum, [-1]), [count]], 0)
            summed = seats.total(packed)
            total, count = tf.reshape(summed[:-1], tf.shape(local_sum)), summed[-1]
        else:  # a count per channel
            count = tf.reduce_sum(tf.cast(kept, x.dtype), axes, keepdims=True)
            total, count = tf.unstack(seats.total(tf.stack([local_sum, count])))
        denominator = count + epsilon if epsilon else count
        mean = total / denominator
        centred = onlykept_values(x - mean)
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
            return (onlykept_values(d_mean) + 2.0 * d_variance * centred) / denominator

        return (mean, variance, count), gradient  # the count takes no gradient

    return moments(x)


def batch_moments(means: Any, variances: Any, counts: Any, epsilon: float) -> tuple:
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

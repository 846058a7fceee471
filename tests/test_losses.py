import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.tolerances import EQUIVALENCE_RTOL
from towers.losses import TowerLoss

Y_TRUE = tf.constant([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
Y_PRED = tf.constant([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
# Per-example mean squared error of the rows above: (0+4)/2, (4+0)/2, (4+0)/2.
PER_EXAMPLE_MSE = [2.0, 2.0, 2.0]


def test_mean_reduction_divides_by_the_global_batch():
    loss = TowerLoss(keras.losses.MeanSquaredError())

    # These 3 examples are one tower's share of a 5-example batch: 6 / 5.
    value = loss.tower_loss(Y_TRUE, Y_PRED, global_batch=5)

    np.testing.assert_allclose(value.numpy(), sum(PER_EXAMPLE_MSE) / 5)


def test_sum_reduction_does_not_divide():
    loss = TowerLoss(keras.losses.MeanSquaredError(reduction="sum"))

    value = loss.tower_loss(Y_TRUE, Y_PRED, global_batch=5)

    np.testing.assert_allclose(value.numpy(), sum(PER_EXAMPLE_MSE))


def test_per_example_function_divides_by_the_global_batch():
    loss = TowerLoss(lambda y, p: tf.reduce_sum(tf.square(y - p), axis=-1))

    value = loss.tower_loss(Y_TRUE, Y_PRED, global_batch=4)

    np.testing.assert_allclose(value.numpy(), (4.0 + 4.0 + 4.0) / 4)


def test_sequence_loss_shares_add_up_to_keras_full_batch_value():
    # Per-timestep losses: Keras divides by B * timesteps, so must the shares.
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 4, (5, 3))
    y_pred = tf.constant(rng.standard_normal((5, 3, 4)), tf.float32)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss = TowerLoss(keras_loss)

    shares = [
        loss.tower_loss(y_true[a:b], y_pred[a:b], global_batch=5)
        for a, b in [(0, 2), (2, 4), (4, 5)]
    ]

    np.testing.assert_allclose(
        tf.add_n(shares).numpy(),
        keras_loss(y_true, y_pred).numpy(),
        rtol=EQUIVALENCE_RTOL,
    )


def test_keras_loss_name_is_looked_up():
    loss = TowerLoss("mse")

    value = loss.tower_loss(Y_TRUE, Y_PRED, global_batch=3)

    np.testing.assert_allclose(value.numpy(), np.mean(PER_EXAMPLE_MSE))


def test_user_loss_object_is_not_modified():
    keras_loss = keras.losses.MeanSquaredError(reduction="sum")

    TowerLoss(keras_loss)

    assert keras_loss.reduction == "sum"


def test_function_returning_two_values_per_example_raises():
    loss = TowerLoss(lambda y, p: tf.square(y - p))

    with pytest.raises(ValueError, match=r"shape \[3\]; received shape \(3, 2\)"):
        loss.tower_loss(Y_TRUE, Y_PRED, global_batch=3)


def test_unknown_reduction_raises():
    keras_loss = keras.losses.MeanSquaredError()
    keras_loss.reduction = "median"

    with pytest.raises(ValueError, match=r"unsupported loss reduction 'median'"):
        TowerLoss(keras_loss)


def test_not_a_loss_raises():
    with pytest.raises(ValueError, match=r"received 42"):
        TowerLoss(42)

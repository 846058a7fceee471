"""The promise: T towers give the same weights as one device on the whole batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import (
    build_dense_sparse_unused,
    build_mlp,
    copy_of,
    dense_sparse_batch,
    regression_batch,
)
from tests.tolerances import ADAM_EPSILON, EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

STEPS = 3
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01, epsilon=ADAM_EPSILON),
}


def devices(num_towers):
    return [f"/cpu:{t}" for t in range(num_towers)]


def reference_trainer(model, loss, optimizer):
    """One device, whole batch: the textbook GradientTape step."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            # A Keras loss object reduces itself; a loss function returns
            # per-example values, which Keras' fit averages.
            value = tf.reduce_mean(loss(y, model(x, training=True)))
            if model.losses:
                value += tf.add_n(model.losses)
        grads = tape.gradient(value, model.trainable_variables)
        pairs = [
            (g, v) for g, v in zip(grads, model.trainable_variables) if g is not None
        ]
        optimizer.apply_gradients(pairs)
        return value

    return step


def assert_same_weights(towers_model, reference_model):
    for got, want, var in zip(
        towers_model.get_weights(), reference_model.get_weights(), towers_model.weights
    ):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=var.path
        )


def run_both(builder, loss, optimizer_name, num_towers, batches):
    """Trains towers and the reference on the same batches; returns both models."""
    with tf.device("/cpu:0"):
        reference = builder()
        towers_model = copy_of(reference, builder)
    ref_opt = OPTIMIZERS[optimizer_name]()
    ref_step = reference_trainer(
        reference, keras.losses.get(loss) if isinstance(loss, str) else loss, ref_opt
    )
    engine = Towers(
        towers_model, loss, OPTIMIZERS[optimizer_name](), devices=devices(num_towers)
    )
    for x, y in batches:
        ref_loss = ref_step(x, y)
        logs = engine.train_step(x, y)
        np.testing.assert_allclose(
            logs["loss"].numpy(), ref_loss.numpy(), rtol=EQUIVALENCE_RTOL
        )
    assert int(engine.optimizer.iterations.numpy()) == len(batches)
    return engine, reference


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("batch", [1, 3, 10, 16])
@pytest.mark.parametrize("num_towers", [1, 2, 3, 4, 8])
def test_towers_equal_one_device_dense_sparse_and_unused(
    num_towers, batch, optimizer_name
):
    rng = np.random.default_rng(batch * 100 + num_towers)
    batches = [dense_sparse_batch(rng, batch) for _ in range(STEPS)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    engine, reference = run_both(
        build_dense_sparse_unused, loss, optimizer_name, num_towers, batches
    )

    assert_same_weights(engine.model, reference)
    unused = [w for w in engine.model.weights if w.path.endswith("unused")][0]
    np.testing.assert_array_equal(unused.numpy(), np.ones(4))  # never updated
    assert engine.trace_count == 1


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.MeanSquaredError(),
        keras.losses.MeanSquaredError(reduction="sum"),
        keras.losses.MeanSquaredError(reduction="mean"),
        "mse",
    ],
    ids=["sum_over_batch_size", "sum", "mean", "name"],
)
def test_towers_equal_one_device_for_every_keras_loss_reduction(loss):
    rng = np.random.default_rng(1)
    batches = [regression_batch(rng, 11) for _ in range(STEPS)]

    engine, reference = run_both(build_mlp, loss, "adam", 4, batches)

    assert_same_weights(engine.model, reference)


def test_towers_equal_one_device_for_a_per_example_function():
    def per_example_mse(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)  # f32[B_t]

    rng = np.random.default_rng(2)
    batches = [regression_batch(rng, 7) for _ in range(STEPS)]
    with tf.device("/cpu:0"):
        reference = build_mlp()
        twin = copy_of(reference, build_mlp)
    ref_step = reference_trainer(reference, per_example_mse, OPTIMIZERS["sgd"]())
    engine = Towers(twin, per_example_mse, OPTIMIZERS["sgd"](), devices=devices(3))
    for x, y in batches:
        ref_step(x, y)
        engine.train_step(x, y)

    assert_same_weights(engine.model, reference)


def build_regularised():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(
                8,
                activation="relu",
                kernel_regularizer=keras.regularizers.L2(0.01),
                activity_regularizer=keras.regularizers.L2(0.001),
            ),
            keras.layers.Dense(2),
        ]
    )


@pytest.mark.parametrize("num_towers", [2, 8])
def test_regularisation_losses_count_once_not_once_per_tower(num_towers):
    rng = np.random.default_rng(3)
    batches = [regression_batch(rng, 9) for _ in range(STEPS)]

    engine, reference = run_both(build_regularised, "mse", "sgd", num_towers, batches)

    assert_same_weights(engine.model, reference)

"""Mixed precision: float16 with loss scaling, bfloat16 without."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import copy_of
from tests.tolerances import (
    ADAM_EPSILON,
    MIXED_BFLOAT16_RTOL,
    MIXED_FLOAT16_RTOL,
)
from towers import Towers


@pytest.fixture
def policy(request):
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


def build():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def build_with_batch_norm():
    model = build()
    model.add(keras.layers.BatchNormalization(momentum=0.5))
    return model


def adam():
    return keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON)


def make_engine(num_towers=4, model=build, optimizer=adam, **kwargs):
    keras.utils.set_random_seed(0)
    return Towers(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer,
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        **kwargs,
    )


def batch(seed, examples=10):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, 6)).astype("float32")
    return x, rng.integers(0, 3, examples).astype("int32")


def reference_step(model, optimizer, x, y):
    """One device, the whole batch, Keras' loss-scaling recipe if it scales."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled = (
            optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        )
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_wraps_the_optimizer_and_keeps_variables_float32(policy):
    engine = make_engine()
    engine.train_step(*batch(0))

    assert isinstance(engine.optimizer, keras.optimizers.LossScaleOptimizer)
    assert {v.dtype for v in engine.model.variables} == {"float32"}
    assert engine.model.layers[0].compute_dtype == "float16"
    for var in engine.optimizer.variables:
        assert var.handle.device.endswith("CPU:0"), (var.path, var.handle.device)


@pytest.mark.parametrize(
    "policy,rtol",
    [("mixed_float16", MIXED_FLOAT16_RTOL), ("mixed_bfloat16", MIXED_BFLOAT16_RTOL)],
    indirect=["policy"],
)
def test_towers_equal_one_device_in_mixed_precision(policy, rtol):
    engine = make_engine(optimizer=lambda: keras.optimizers.SGD(0.1))
    with tf.device("/cpu:0"):
        model = copy_of(engine.model, build)
        optimizer = keras.optimizers.SGD(0.1)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)

    start = model.get_weights()
    for seed in range(3):
        x, y = batch(seed)
        engine.train_step(x, y)
        reference_step(model, optimizer, x, y)

    # The variables are float32, but the gradients are summed in 16 bits within a
    # tower and in float32 across towers (see tolerances.py): compare each
    # variable's total change, relative to its size.
    for w0, mine, theirs in zip(start, engine.model.get_weights(), model.get_weights()):
        error = np.linalg.norm((mine - w0) - (theirs - w0))
        assert error <= rtol * np.linalg.norm(theirs - w0), (error, theirs - w0)
    assert type(engine.optimizer) is type(optimizer)
    assert int(engine.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_each_tower_scales_its_loss_before_the_gradient(policy):
    engine = make_engine()
    engine.train_step(*batch(0))
    x, y, _ = engine.prepare(*batch(1, examples=3))
    tower = engine.step.builtin

    def grads():
        tower_pass = tower.forward(engine.model, x, y, None, examples=3)
        divisors = [term.divisor for term in tower_pass.terms]
        return tower.gradients(tower_pass, divisors).grads

    engine.optimizer.dynamic_scale.assign(1.0)
    unscaled = grads()
    engine.optimizer.dynamic_scale.assign(1024.0)
    scaled = grads()

    for a, b in zip(scaled, unscaled):
        np.testing.assert_allclose(a.numpy(), 1024.0 * b.numpy(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_infinite_gradient_changes_no_variable_and_halves_the_scale(policy):
    engine = make_engine(model=build_with_batch_norm)  # its statistics stay too
    engine.train_step(*batch(0))
    model_before = [v.numpy().copy() for v in engine.model.variables]
    inner_before = [
        v.numpy().copy() for v in engine.optimizer.inner_optimizer.variables
    ]
    scale = float(engine.optimizer.dynamic_scale.numpy())

    x, y = batch(1)
    x[8] = 1e5  # float16 overflows (max 65504) in the last tower: inf gradients
    engine.train_step(x, y)

    for before, var in zip(model_before, engine.model.variables):
        np.testing.assert_array_equal(before, var.numpy(), err_msg=var.path)
    for before, var in zip(inner_before, engine.optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(before, var.numpy(), err_msg=var.path)
    assert int(engine.optimizer.iterations.numpy()) == 1
    assert float(engine.optimizer.dynamic_scale.numpy()) == scale / 2


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_refuses_on_nonfinite_raise(policy):
    with pytest.raises(ValueError, match="'raise' cannot be used with a LossScale"):
        make_engine(on_nonfinite="raise")

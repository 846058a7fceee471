"""on_nonfinite: a step whose combined gradient has an inf or NaN."""

import keras
import numpy as np
import pytest

from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.placement.update import finite_flags


def build():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.BatchNormalization(momentum=0.5, name="norm"),
            keras.layers.Dense(2, name="out"),
        ],
        name="net",
    )


class SqrtGate(keras.layers.Layer):
    """x + x * sqrt(gate), gate = 0: a finite output whose gate gradient is inf."""

    def build(self, input_shape):
        self.gate = self.add_weight(shape=(), initializer="zeros", name="gate")

    def call(self, x):
        return x + x * keras.ops.sqrt(self.gate)


def build_with_gate():
    model = build()
    model.add(SqrtGate(name="sqrt_gate"))
    return model


def make_engine(on_nonfinite, num_towers=3, model=build):
    keras.utils.set_random_seed(0)
    return Towers(
        model,
        "mse",
        lambda: keras.optimizers.Adam(0.01),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        on_nonfinite=on_nonfinite,
    )


def batch(seed, examples=9, poison=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, 4)).astype("float32")
    y = rng.standard_normal((examples, 2)).astype("float32")
    if poison is not None:
        y[poison] = np.inf  # one example of one tower: every gradient is inf/NaN
    return x, y


def state(engine):
    """Every variable the step could change: model, optimizer, BN statistics."""
    return [v.numpy().copy() for v in engine.model.variables] + [
        v.numpy().copy() for v in engine.optimizer.variables
    ]


def assert_unchanged(before, engine):
    for a, b in zip(before, state(engine)):
        np.testing.assert_array_equal(a, b)


def test_skip_leaves_every_variable_unchanged():
    engine = make_engine("skip")
    engine.train_step(*batch(0))
    before = state(engine)

    logs = engine.train_step(*batch(1, poison=7))  # example 7: the last tower

    assert not np.isfinite(float(logs["loss"]))  # the bad loss is still reported
    assert_unchanged(before, engine)
    assert int(engine.optimizer.iterations.numpy()) == 1


def test_skip_then_train_equals_never_seeing_the_bad_batch():
    skipped, clean = make_engine("skip"), make_engine("skip")
    skipped.train_step(*batch(0))
    skipped.train_step(*batch(1, poison=0))
    skipped.train_step(*batch(2))
    clean.train_step(*batch(0))
    clean.train_step(*batch(2))

    for a, b in zip(state(skipped), state(clean)):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_raise_names_the_variable_and_applies_nothing():
    engine = make_engine("raise")
    engine.train_step(*batch(0))
    before = state(engine)

    with pytest.raises(FloatingPointError) as error:
        engine.train_step(*batch(1, poison=4))

    # Every gradient is NaN here, so the first is the first trainable variable's.
    assert "'net/hidden/kernel' is not finite" in str(error.value)
    assert "nothing was applied" in str(error.value)
    assert_unchanged(before, engine)


def test_raise_names_the_first_nonfinite_variable_not_the_first_variable():
    engine = make_engine("raise", model=build_with_gate)
    before = state(engine)

    with pytest.raises(FloatingPointError, match="'net/sqrt_gate/gate' is not finite"):
        engine.train_step(*batch(0))  # the loss is finite; only d/d gate is inf
    assert_unchanged(before, engine)


def test_raise_with_finite_gradients_trains_as_ignore():
    checked, unchecked = make_engine("raise"), make_engine("ignore")
    for seed in range(3):
        checked.train_step(*batch(seed))
        unchecked.train_step(*batch(seed))
    # Not bit for bit: the update inside a cond is compiled a little differently.
    for a, b in zip(state(checked), state(unchecked)):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_ignore_applies_the_nonfinite_update_as_keras_does():
    engine = make_engine("ignore")
    engine.train_step(*batch(1, poison=2))
    kernel = engine.model.get_layer("out").kernel.numpy()
    assert not np.isfinite(kernel).all()


def test_finite_flags_point_at_the_first_bad_gradient():
    import tensorflow as tf

    grads = [
        tf.constant([1.0, 2.0]),
        tf.IndexedSlices(tf.constant([[1.0], [np.nan]]), tf.constant([0, 3])),
        tf.constant([np.inf]),
    ]
    flags = finite_flags(grads).numpy()
    assert flags.tolist() == [True, False, False]
    assert int(np.argmin(flags)) == 1


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"one of \['ignore', 'raise', 'skip'\]"):
        make_engine("warn")

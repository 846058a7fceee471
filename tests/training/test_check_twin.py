"""The check in float32 and 16 bits (towers/training/twin.py): a mechanism
of a tenth of a per cent of a change, which float32's rounding could hide,
is found in the model's float64 twin and refused by name before any update;
a model without a twin is said so and trains."""

import contextlib
import warnings

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from tests.training.test_check import regression
from towers import Towers


class RowScaled(keras.layers.Layer):
    """Its inputs times ``1 + per_row * rows``: a layer that reads how many
    rows it is given, which no rule of towers knows. With 20 examples on 2
    towers and ``per_row=1e-4`` its output is 0.1 % off one device's."""

    def __init__(self, per_row=1e-4, **kwargs):
        super().__init__(**kwargs)
        self.per_row = per_row

    def call(self, x):
        rows = keras.ops.cast(keras.ops.shape(x)[0], x.dtype)
        return x * (1.0 + self.per_row * rows)

    def get_config(self):
        return {**super().get_config(), "per_row": self.per_row}


def row_scaled(per_row, dtype=None):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    hidden = RowScaled(per_row, name="scaled", dtype=dtype)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_tenth_of_a_per_cent_in_float32_is_refused_by_its_float64_twin():
    x, y = regression(count=20)
    model = row_scaled(1e-4)
    engine = Towers(model, devices=devices(2))
    before = [v.numpy() for v in model.variables]

    with pytest.raises(ValueError, match="not one device's") as refused:
        engine.fit(x, y, batch_size=20, epochs=1, verbose=0, shuffle=False)

    message = str(refused.value)
    assert "in the model's float64 twin" in message, message
    assert f"{model.get_layer('hidden').kernel.path} (layer hidden)" in message
    assert int(engine.optimizer.iterations) == 0  # nothing was updated
    for var, value in zip(model.variables, before):
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)


def test_eight_towers_are_checked_in_a_twin_of_two_on_their_shards_rows():
    # 30 rows on 8 towers: shards of 4 and 3 rows, each scaled by 1.0004 or
    # 1.0003 where one device's 30 rows are by 1.003 (0.26 % apart). The
    # twin runs two towers on the first shard's rows and the last's, which
    # two towers cut into the same shards.
    x, y = regression(count=30)
    model = row_scaled(1e-4)
    engine = Towers(model, devices=devices(8))

    with pytest.raises(ValueError, match="not one device's") as refused:
        engine.fit(x, y, batch_size=30, epochs=1, verbose=0, shuffle=False)

    message = str(refused.value)
    assert "on two towers, the rows of the first and the last of the 8" in message
    assert f"{model.get_layer('hidden').kernel.path} (layer hidden)" in message
    assert int(engine.optimizer.iterations) == 0

    assert not Towers(row_scaled(0.0), devices=devices(8)).check(x, y).differs


def test_the_same_difference_in_float32_alone_is_rounding_to_the_check():
    # What the twin adds: in the model's own dtype, 0.16 % of a change is
    # within what float32's rounding reaches on deep networks (15 %).
    x, y = regression(count=20)
    comparison = Towers(row_scaled(1e-4), devices=devices(2)).check(x, y)
    assert comparison.in_twin and comparison.twin is not None
    assert not [d for d in comparison.differences if d.differs]
    kernel = [d for d in comparison.twin.differences if d.path.endswith("kernel")]
    assert all(1e-3 < d.relative < 1e-2 for d in kernel), str(comparison)
    assert comparison.verdict().startswith("NOT one device's step")


def test_mixed_precision_is_checked_in_the_twin_too():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x, y = regression(count=20)
        engine = Towers(row_scaled(3e-4), devices=devices(2))
        comparison = engine.check(x, y)
        exact = Towers(row_scaled(0.0), devices=devices(2)).check(x, y)
    finally:
        keras.config.set_dtype_policy("float32")
    assert comparison.in_twin, str(comparison)
    assert exact.differs == [], str(exact)


def test_a_model_one_device_trains_alike_passes_with_its_twin_at_rounding():
    x, y = regression(count=20)
    comparison = Towers(row_scaled(0.0), devices=devices(2)).check(x, y)
    assert comparison.differs == [], str(comparison)
    if comparison.twin is not None:  # float32 alone may leave no room
        assert max(d.relative for d in comparison.twin.differences) < 1e-12


class NoConfig(keras.Model):
    """A subclass whose ``__init__`` takes what its config cannot give back."""

    def __init__(self, width):
        super().__init__()
        self.hidden = keras.layers.Dense(width, activation="tanh")
        self.scaled = RowScaled(1e-4)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.scaled(self.hidden(x)))


def test_a_model_without_a_twin_is_said_once_and_checked_in_its_dtype():
    x, y = regression(count=20)
    keras.utils.set_random_seed(1)
    model = NoConfig(16)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    engine = Towers(model, devices=devices(2))
    with pytest.warns(UserWarning, match="cannot check NoConfig's step in a float64"):
        engine.fit(x, y, batch_size=20, epochs=1, verbose=0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
    assert engine.steps_done == 3


def test_a_new_trace_in_float32_is_checked_in_the_twin_before_its_update():
    # Exact for its first trace; then the layer reads its rows (a Python
    # attribute the next trace reads) and a batch of a new shape traces the
    # step anew: 0.1 % apart, refused at that trace's first step.
    x, y = regression(count=30)
    model = row_scaled(0.0)
    engine = Towers(model, devices=devices(2))
    engine.fit(x[:10], y[:10], batch_size=10, epochs=1, verbose=0, shuffle=False)
    model.get_layer("scaled").per_row = 1e-4
    before = [v.numpy() for v in model.variables]

    with pytest.raises(ValueError, match="a new trace of the step") as refused:
        engine.fit(x[10:], y[10:], batch_size=20, epochs=1, verbose=0)

    assert "in the model's float64 twin" in str(refused.value)
    assert engine.steps_done == 1
    for var, value in zip(model.variables, before):
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)


def test_the_twin_starts_from_the_trained_state_at_a_later_check():
    # Trained exact, then the layer reads its rows (a Python attribute: the
    # next trace's); the check of the new trace finds it in the twin, made
    # from the weights and Adam slots trained so far.
    x, y = regression(count=30)
    model = row_scaled(0.0)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    engine = Towers(model, devices=devices(2))
    engine.fit(x[:20], y[:20], batch_size=20, epochs=2, verbose=0, shuffle=False)
    model.get_layer("scaled").per_row = 2e-4
    comparison = engine.check(x[20:], y[20:])
    assert comparison.in_twin, str(comparison)
    twin = engine._twin.engine
    assert twin.model.get_layer("scaled").per_row == 2e-4
    assert str(twin.model.weights[0].dtype) == "float64"
    pairs = zip(engine.optimizer.variables, twin.optimizer.variables, strict=True)
    for mine, theirs in pairs:  # put back to the state it was copied from
        np.testing.assert_allclose(theirs.numpy(), mine.numpy(), rtol=1e-6)
    assert int(twin.optimizer.iterations) == 2


def float8_row_scaled(per_row):
    model = row_scaled(per_row)
    with pytest.warns(UserWarning, match="quantize"):  # Keras: InputLayer
        model.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_float8_model_is_checked_in_its_float64_twin():
    # Rebuilt from its config, a float8 layer makes its scales and amax
    # histories before its kernel: the twin takes each variable by path.
    # In float32 an element near a float8 boundary rounds to the next step
    # (a quarter of its value in e5m2) on one side only, so the check in
    # float32 must let 0.2 % through; in float64 nothing is near a boundary.
    x, y = regression(count=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "cannot check ... twin"
        exact = Towers(float8_row_scaled(0.0), devices=devices(2)).check(x, y)
        coupled = Towers(float8_row_scaled(1e-4), devices=devices(2)).check(x, y)
    assert exact.twin is not None and exact.differs == [], str(exact)
    assert max(d.relative for d in exact.twin.differences) < 1e-9, str(exact)
    assert coupled.in_twin, str(coupled)
    assert "scaled" in coupled.verdict() or "hidden" in str(coupled), str(coupled)


def test_the_twins_functions_are_built_without_grappler_and_no_other():
    # Grappler folds 2 * 3 to a constant; a function first called inside
    # unoptimised_calls keeps its Mul, and one called after is folded again.
    import tensorflow as tf

    from towers._runtime import placed_graphs, unoptimised_calls

    def ops_placed(inside):
        @tf.function
        def f(x):
            return x + tf.constant(2.0) * tf.constant(3.0)

        with placed_graphs() as functions:
            with unoptimised_calls() if inside else contextlib.nullcontext():
                assert float(f(tf.constant(1.0))) == 7.0
        return {node.op for graphs in functions for g in graphs for node in g.node}

    assert "Mul" not in ops_placed(False)
    assert "Mul" in ops_placed(True)
    assert "Mul" not in ops_placed(False)

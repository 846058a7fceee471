"""A tower's pass traced once and cut into phases (towers/step/run/cut.py) runs
what one device's step runs: a recurrent layer's loop and its gradient, and
the ops that run for what they do (an assert, a print), on every tower, in
each way the cut serves: one phase ("shared"), and phases around the sums of
global batch statistics, with XLA and without. Against Keras' own fit,
float64, uneven shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import assert_same_updates
from tests.test_equivalence import devices
from towers import Towers
from towers.step.run import xla

WAYS = {"shared": {}, "phases": {"batch_statistics": "global"}}


def recurrent(normalised=False, jit_compile=False):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 3))
    hidden = keras.layers.LSTM(5, return_sequences=True)(inputs)
    hidden = keras.layers.GRU(4)(hidden)
    if normalised:  # the whole batch's statistics: the towers meet there
        hidden = keras.layers.BatchNormalization(momentum=0.8)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile
    )
    return model


@pytest.mark.usefixtures("float64")  # tests/conftest.py
@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_recurrent_model_trains_as_keras_fit(num_towers, way):
    # A loop's gradient gives the forward loop inputs made after it (what it
    # keeps for the backward pass): the cut must order the ops by what they
    # read, not by when they were made.
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((21, 6, 3)), rng.standard_normal((21, 2))
    build = lambda: recurrent(normalised=way == "phases")  # noqa: E731
    engine = Towers(build, devices=devices(num_towers), **WAYS[way])
    reference = build()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8, 8, 5
    history = engine.fit(x, y, **fit)
    expected = reference.fit(x, y, **fit)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-12
    )


@pytest.mark.usefixtures("float64", "xla_allowed")  # tests/conftest.py
def test_a_recurrent_model_trains_with_xla_as_keras_xla_fit():
    # With XLA the loops' gradients keep their values in lists of a known
    # length, as Keras' XLA step traces them; else XLA cannot compile them.
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((21, 6, 3)), rng.standard_normal((21, 2))
    build = lambda: recurrent(jit_compile=True)  # noqa: E731
    engine = Towers(build, devices=devices(2), jit_compile=True)
    reference = build()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, y, **fit)
    expected = reference.fit(x, y, **fit)

    assert reference.jit_compile and engine.step.builtin.jit.enabled
    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-12
    )


@pytest.mark.usefixtures("float64", "xla_allowed")
def test_a_loops_kept_values_between_xla_phases_are_named_or_run_without_xla():
    # Under global statistics the towers meet between the loops' forward and
    # backward passes: the lists the loops keep would cross between XLA
    # computations, which XLA cannot do.
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 6, 3)), rng.standard_normal((16, 2))
    build = lambda: recurrent(normalised=True)  # noqa: E731
    fit = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
    strict = Towers(
        build, devices=devices(2), jit_compile=True, batch_statistics="global"
    )
    start = strict.model.get_weights()
    with pytest.raises(ValueError, match="a list a loop keeps for its backward"):
        strict.fit(x, y, **fit)
    for got, want in zip(strict.model.get_weights(), start):
        np.testing.assert_array_equal(got, want)  # nothing was applied

    auto = Towers(build, devices=devices(2), batch_statistics="global")
    auto.step.builtin.jit = xla.Jit(enabled=True, strict=False)  # "auto" on a GPU
    reference = build()
    before = reference.get_weights()
    with pytest.warns(UserWarning, match="so the towers run without XLA"):
        auto.fit(x, y, **fit)
    reference.fit(x, y, **fit)
    assert_same_updates(auto.model, reference, before)


class Checked(keras.layers.Layer):
    """Refuses an input over a bound, and prints a line per call, to ``path``."""

    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        self.printed = path

    def call(self, x):
        tf.debugging.assert_less(tf.reduce_max(x), 100.0, message="over 100")
        tf.print("called", output_stream=f"file://{self.printed}")
        return x


@pytest.mark.parametrize("way", list(WAYS))
def test_an_assert_and_a_print_run_on_every_tower(tmp_path, way):
    # Nothing reads them, so only their effects say they ran: a print per
    # tower, and an assert that fails the step on a batch over its bound.
    path = tmp_path / "printed.txt"
    inputs = keras.Input((3,))
    hidden = keras.layers.BatchNormalization()(Checked(str(path))(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    engine = Towers(model, devices=devices(2), **WAYS[way])
    x, y = np.ones((6, 3), "float32"), np.ones((6, 1), "float32")
    engine.train_step(x, y)  # the first step's probe calls the model too
    first = len(path.read_text().split())
    engine.train_step(x, y)

    assert len(path.read_text().split()) - first == 2  # once per tower
    with pytest.raises(tf.errors.InvalidArgumentError, match="over 100"):
        engine.train_step(x * 1000, y)

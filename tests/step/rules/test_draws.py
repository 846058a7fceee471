"""Random draws on towers are one device's (towers/step/rules/draws.py): every
tower starts from the step's seed states and draws its rows of the whole
batch's numbers, and the states move once. Against Keras' own fit on one
device, float64, uneven shards, every way the runner runs the towers."""

import random
import warnings

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.step.rules import draws, loss_kinds, places
from towers.step.run import phases, runner, seats

FIT = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)


class Picked(keras.layers.Layer):
    """In training, adds a tenth of a class drawn from each row's first three
    values (``keras.random.categorical``: a draw per row of its input)."""

    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(11)

    def call(self, x, training=False):
        if not training:
            return x
        picked = keras.random.categorical(x[:, :3], 1, seed=self.seed)
        return x + 0.1 * keras.ops.cast(picked, x.dtype)


def noisy(normalised=False, loss="mse"):
    """Dropout, GaussianNoise and a categorical draw in training; with a
    BatchNormalization layer before them (``normalised``)."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation="tanh", use_bias=not normalised)
    x = hidden(inputs)
    if normalised:
        x = keras.layers.BatchNormalization(momentum=0.5)(x)
    x = keras.layers.Dropout(0.4, seed=3)(x)
    x = keras.layers.GaussianNoise(0.1, seed=4)(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(Picked()(x)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    return model


def assert_every_variable_as_keras(model, reference, before, tolerances=(1e-12, 1e-14)):
    """Every variable's update, the seed generators' states included (in
    float32, the same draws: the towers' sums round apart)."""
    states = [v for v in reference.variables if "seed_generator" in v.path]
    assert len(states) == 3
    rtol, atol = tolerances
    for got, want, b in zip(model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=rtol, atol=atol,
            err_msg=want.path,
        )  # fmt: skip


def fit_both(build, num_towers, sample_weight=None, **options):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((23, 5)), rng.standard_normal((23, 2))
    engine = Towers(build(), devices=devices(num_towers), **options)
    reference = build()
    before = [v.numpy() for v in reference.variables]
    engine.fit(x, y, sample_weight=sample_weight, **FIT)
    reference.fit(x, y, sample_weight=sample_weight, **FIT)
    return engine.model, reference, before


@pytest.mark.parametrize("num_towers", [2, 3])
def test_draws_in_one_traced_pass_are_one_devices(float64, num_towers):
    assert_every_variable_as_keras(*fit_both(noisy, num_towers))


def test_draws_in_float32_are_one_devices():
    # A 32-bit value is a quarter of a Philox counter step, a 64-bit one half.
    tolerances = (EQUIVALENCE_RTOL, EQUIVALENCE_ATOL)
    assert_every_variable_as_keras(*fit_both(noisy, 3), tolerances)


def test_draws_tower_by_tower_are_one_devices(float64, monkeypatch):
    # A divisor from sample weights: without XLA the towers are traced one by
    # one, once the one trace has met at the divisor's sum.
    met = []
    compute = phases.compute

    def counted(*args):
        try:
            return compute(*args)
        except seats.Unserved:
            met.append(1)
            raise

    monkeypatch.setattr(phases, "compute", counted)
    weighted = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    weights = np.linspace(0.5, 2.0, 23)
    build = lambda: noisy(loss=weighted)  # noqa: E731
    assert_every_variable_as_keras(*fit_both(build, 3, sample_weight=weights))
    assert met  # and then alone


class Unseeded(keras.layers.Layer):
    """In training, adds a normal draw from Keras' global seed generator
    (``seed=None``), which the model does not track."""

    def call(self, x, training=False):
        return x + keras.random.normal(keras.ops.shape(x)) if training else x


def unseeded():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    x = Unseeded()(keras.layers.Dense(4, activation="tanh")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def global_state():
    return keras.src.random.seed_generator.global_seed_generator().state.numpy()


def test_draws_from_the_global_generator_are_one_devices_unwarned(float64, recwarn):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((23, 5)), rng.standard_normal((23, 2))
    reference = unseeded()
    engine = Towers(unseeded(), devices=devices(3))
    before = reference.get_weights()
    keras.utils.set_random_seed(9)  # the global generator starts again
    reference.fit(x, y, **FIT)
    want = global_state()
    keras.utils.set_random_seed(9)
    engine.fit(x, y, **FIT)

    np.testing.assert_array_equal(global_state(), want)  # moved once a step
    for got, wanted, b in zip(
        engine.model.get_weights(), reference.get_weights(), before
    ):
        np.testing.assert_allclose(got - b, wanted - b, rtol=1e-12, atol=1e-14)
    assert not [w for w in recwarn if "seed_generator_state" in str(w.message)]


class Workers:
    """Stands for a cluster's workers: a model without seed generators of its
    own never asks them for its first row."""

    def first_row(self, examples):
        raise AssertionError("not asked")


def test_a_global_generators_draw_per_row_in_a_cluster_is_refused_by_name():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    with draws.drawing(Workers(), [model], 8), places.rows(4, 0):
        keras.random.normal((1, 3))  # the same on every worker: one device's
        with pytest.raises(ValueError, match=r"keras.random.normal with seed=None"):
            keras.random.normal((4, 3))
        with pytest.raises(ValueError, match=r"keras.random.dropout with seed=None"):
            keras.random.dropout(np.ones((4, 3), "float32"), 0.5)
        # A generator the model does not hold: its rows not placed, named.
        with pytest.warns(UserWarning, match=r"not among the model's variables"):
            keras.random.normal((4, 3), seed=keras.random.SeedGenerator(1))
    with draws.drawing(None, [model], 8), places.rows(4, 0):
        assert keras.random.normal((4, 3)).shape == (4, 3)  # one process: placed


# A tower of rows 8-11 of 16 (its data's second part, if any, 3 of 12 rows):
# a draw's rows -> (the part's rows, its first row, the batch's, blocks k).
PLACES = {
    "the shard's rows": ((), 4, (4, 8, 16, 1)),
    "three blocks of them": ((), 12, (4, 8, 16, 3)),
    "no part's rows": ((), 5, None),
    "the second part's rows": ((3,), 3, (3, 6, 12, 1)),
    "a multiple of one of two parts": ((3,), 8, (4, 8, 16, 0)),
    "both parts' rows together": ((3,), 7, (4, 8, 16, 0)),
    "neither part's rows": ((3,), 5, None),
}


@pytest.mark.parametrize("name", sorted(PLACES))
def test_a_draw_is_placed_over_a_part_or_blocks_of_the_shard_else_named(name):
    others, rows, expected = PLACES[name]
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    with draws.drawing(None, [model], 16), places.rows(4, 8, 16, others):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert places.place(rows, "normal") == expected
    named = [str(w.message) for w in caught]
    assert len(named) == (expected is not None and expected[3] == 0), named


@pytest.mark.parametrize("cut", [True, False], ids=["phases", "turns"])
def test_draws_after_global_batch_moments_are_one_devices(float64, monkeypatch, cut):
    if not cut:  # the lockstep the runner falls back to
        monkeypatch.setattr(phases, "compute", _uncuttable)
    fallbacks = []
    in_turns = runner.in_turns
    monkeypatch.setattr(
        runner, "in_turns", lambda *a: fallbacks.append(1) or in_turns(*a)
    )
    build = lambda: noisy(normalised=True)  # noqa: E731
    trained = fit_both(build, 3, batch_statistics="global")
    assert bool(fallbacks) is not cut
    assert_every_variable_as_keras(*trained)


class Shuffling(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(2)

    def call(self, x, training=False):
        return keras.random.shuffle(x, seed=self.seed) if training else x


def test_a_shuffle_of_the_examples_is_refused_by_name_before_any_update():
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(2)(Shuffling()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    before = [v.numpy() for v in model.variables]
    engine = Towers(model, devices=devices(2))
    x, y = np.ones((8, 5)), np.ones((8, 2))

    with pytest.raises(ValueError, match=r"keras.random.shuffle along the examples"):
        engine.fit(x, y, batch_size=8, verbose=0)

    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def _uncuttable(*arguments):
    raise seats.Unserved("forced by the test")


class PairedNoise(keras.layers.Layer):
    """Noise drawn over twice the rows, its halves added: a draw over two
    blocks of the rows."""

    def __init__(self):
        super().__init__()
        self.seeds = keras.random.SeedGenerator(3)

    def call(self, x, training=False):
        if not training:
            return x
        rows = keras.ops.shape(x)[0]
        noise = keras.random.normal((2 * rows, 5), seed=self.seeds, dtype=x.dtype)
        return x + 0.1 * (noise[:rows] + noise[rows:])


def paired(normalised=False):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,)), PairedNoise(), keras.layers.Dense(4, use_bias=False)]
    layers += [keras.layers.BatchNormalization()] if normalised else []
    model = keras.Sequential([*layers, keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


# Without a meeting the towers run alone (or once); with global batch
# statistics in phases (a cut pass), and in turns where the cut is refused.
@pytest.mark.parametrize("way", ["alone", "phases", "turns"])
def test_a_draw_over_blocks_of_the_rows_in_towers_own_step_is_one_devices(
    float64, monkeypatch, way
):
    if way == "turns":
        monkeypatch.setattr(phases, "compute", _uncuttable)
    model, reference, before = fit_both(lambda: paired(normalised=way != "alone"), 3)
    for got, want, b in zip(model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=1e-12, atol=1e-14,
            err_msg=want.path,
        )  # fmt: skip


class Chosen(keras.layers.Layer):
    """Chooses its operation with Python's ``random`` while it is traced, as
    Keras' AugMix chooses each chain's: one trace, one choice for the batch."""

    def call(self, x, training=False):
        scales = [2.0, -3.0, 0.5, 5.0, -0.25, 1.5, -1.0, 4.0]
        return x * random.choice(scales)


def chosen(normalised=False):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(4, activation="tanh")(inputs)
    if normalised:
        x = keras.layers.BatchNormalization()(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(Chosen()(x)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def fit_from_one_python_state(engine, reference):
    """Keras' fit and the engine's from one Python random state, every
    variable's update compared; where each left the state (the next number
    drawn from it)."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((24, 5)), rng.standard_normal((24, 2))
    before = [v.numpy() for v in reference.variables]
    random.seed(5)
    reference.fit(x, y, **FIT)
    keras_after = random.random()
    random.seed(5)
    engine.fit(x, y, **FIT)
    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=1e-12, atol=1e-14,
            err_msg=want.path,
        )  # fmt: skip
    return random.random(), keras_after


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_layers_python_random_choice_while_traced_is_one_devices(
    float64, jit_compile
):
    # Uneven shards (8 rows on 3 towers) trace each shape apart: every
    # tower's trace must see the Python random state one device's trace
    # sees, and leave it where that trace does.
    reference, model = chosen(), chosen()
    engine = Towers(model, devices=devices(3), jit_compile=jit_compile)
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      jit_compile=jit_compile)  # fmt: skip
    after, keras_after = fit_from_one_python_state(engine, reference)
    assert after == keras_after


def test_a_python_random_choice_traced_in_turns_is_one_devices(float64, monkeypatch):
    # Towers traced in turns each trace in a thread of their own: each must
    # start from the Python random state one device's trace starts from,
    # which the step's context hands every tower's thread.
    monkeypatch.setattr(phases, "compute", _uncuttable)  # global moments: turns
    fallbacks = []
    in_turns = runner.in_turns
    monkeypatch.setattr(
        runner, "in_turns", lambda *a: fallbacks.append(1) or in_turns(*a)
    )
    reference, model = chosen(normalised=True), chosen(normalised=True)
    engine = Towers(model, devices=devices(3), batch_statistics="global")
    after, keras_after = fit_from_one_python_state(engine, reference)
    assert fallbacks and after == keras_after


def test_a_python_random_choice_is_no_coupling_of_the_examples():
    # A refusal blames a coupling only where outputs read other rows: each
    # call's Python random choice must be the same for the probe's calls.
    x = np.random.default_rng(0).standard_normal((4, 5)).astype("float32")
    model = chosen()
    state = random.getstate()
    assert loss_kinds.coupling_layer(model, x, "/CPU:0") is None
    assert random.getstate() == state  # and nothing drawn


class Augmented(keras.Model):
    """Keras' own AugMix as the whole model, as Keras' layer test trains
    it: its chains are Python random choices made while traced, each
    drawing from its own seed generators."""

    def __init__(self):
        super().__init__()
        self.augment = keras.layers.AugMix(
            value_range=(0, 255), num_chains=2, chain_depth=2, factor=1,
            all_ops=True, interpolation="nearest", seed=43,
        )  # fmt: skip

    def call(self, x, training=False):
        return self.augment(x, training=training)


def augmented():
    model = Augmented()
    model.build((None, 3, 4, 3))
    model.compile(optimizer="sgd", loss=lambda y, p: keras.ops.sum(p))
    return model


@pytest.mark.parametrize("python_seed", [1, 2, 6])
def test_augmix_leaves_every_seed_state_where_one_device_does(python_seed):
    # How far each seed generator moves depends on which chains the trace
    # chose: a tower's trace choosing its own moves them otherwise.
    x = np.random.default_rng(0).uniform(0, 255, (8, 3, 4, 3)).astype("float32")
    y = np.zeros_like(x)
    reference, model = augmented(), augmented()
    random.seed(python_seed)
    reference.fit(x, y, batch_size=8, epochs=2, verbose=0)
    random.seed(python_seed)
    Towers(model, devices=devices(2)).fit(x, y, batch_size=8, epochs=2, verbose=0)
    states = [v for v in reference.variables if "seed_generator" in v.path]
    assert len(states) == 10 and any(int(v[1]) > 0 for v in states)
    for got, want in zip(model.variables, reference.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)

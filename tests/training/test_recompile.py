"""A model compiled again while its Towers engine is kept: the engine's next
fit, evaluate or predict takes up the new compile, as Keras' own do
(``towers/training/recompile.py``), against Keras' fit on one device."""

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

FIT = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)


def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 4)).astype("float32")
    return x, (x @ rng.standard_normal((4, 2))).astype("float32")


def base_and_head():
    keras.utils.set_random_seed(2)
    base = keras.layers.Dense(5, activation="tanh", name="base")
    model = keras.Sequential([keras.Input((4,)), base, keras.layers.Dense(2)])
    base.trainable = False
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


def fine_tune(model, fit):
    """Keras' transfer-learning recipe: train the head, unfreeze the base,
    compile again with a new optimizer, loss and metric, train on."""
    x, y = data()
    first = fit(x, y)
    model.get_layer("base").trainable = True
    model.compile(keras.optimizers.Adam(0.01), "mae", metrics=["mse"])
    return first, fit(x, y)


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_a_kept_engine_trains_as_the_model_is_compiled_again():
    model, reference = base_and_head(), base_and_head()
    engine = Towers(model, devices=devices(2))

    got = fine_tune(model, lambda x, y: engine.fit(x, y, **FIT).history)
    want = fine_tune(reference, lambda x, y: reference.fit(x, y, **FIT).history)

    for mine, theirs in zip(got, want):
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            assert_close(mine[key], theirs[key])
    assert sorted(got[1]) == ["loss", "mse"]  # the second compile's metric
    for var, theirs in zip(engine.model.variables, reference.variables):
        assert_close(var.numpy(), theirs.numpy())
    assert isinstance(engine.optimizer, keras.optimizers.Adam)


def test_an_engine_made_to_predict_trains_once_the_model_is_compiled():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    engine = Towers(model, devices=devices(2))
    x, y = data()
    assert_close(engine.predict(x, verbose=0), reference.predict(x, verbose=0))

    for m in (model, reference):
        m.compile(keras.optimizers.SGD(0.1), "mse")
    history = engine.fit(x, y, **FIT).history
    expected = reference.fit(x, y, **FIT).history

    assert_close(history["loss"], expected["loss"])
    assert_close(engine.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))


def test_a_loss_given_to_towers_still_wins_over_a_later_compile():
    model = base_and_head()
    engine = Towers(model, loss="mae", devices=devices(2))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = data()
    got = engine.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    expected = float(np.mean(np.abs(model.predict(x, verbose=0) - y)))
    np.testing.assert_allclose(got, expected, rtol=EQUIVALENCE_RTOL)


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_an_engine_whose_model_is_not_compiled_again_is_kept(call):
    model = base_and_head()
    engine = Towers(model, devices=devices(2))
    step = engine.step
    x, y = data()
    getattr(engine, call)(x, *([y] if call != "predict" else []), verbose=0)
    assert engine.step is step


@pytest.mark.parametrize("placement", ["central", "replicated"])
def test_a_frozen_layer_gets_no_slots_and_the_state_loads_in_keras(placement, tmp_path):
    # Keras' fit builds the optimizer for the variables trainable then: a
    # frozen encoder's get none (keras.io's masked language model froze a
    # BERT and towers had built 36 slots for it), so a checkpoint saved
    # after towers is Keras' own, variable for variable.
    def frozen_base():
        model = base_and_head()
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    engine = Towers(frozen_base, devices=devices(2), placement=placement)
    model, reference, x, y = engine.model, frozen_base(), *data()
    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)
    # Keras' slots, one for one (their names carry each model's own name).
    shapes = lambda m: [tuple(v.shape) for v in m.optimizer.variables]  # noqa: E731
    assert shapes(model) == shapes(reference)
    assert not any("base" in v.path for v in model.optimizer.variables)
    for mine, theirs in zip(model.optimizer.variables, reference.optimizer.variables):
        assert_close(mine.numpy(), theirs.numpy())
    model.save(tmp_path / "towers.keras")
    loaded = keras.saving.load_model(tmp_path / "towers.keras")
    assert shapes(loaded) == shapes(reference)  # loaded as Keras' own
    for mine, theirs in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_a_layer_unfrozen_after_the_first_step_gets_its_slots_then():
    # Keras' fit would need a new optimizer here; towers builds on the one
    # it has: the unfrozen layer's slots start at zero, as built at first.
    model = base_and_head()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    engine = Towers(model, devices=devices(2))
    x, y = data()
    engine.fit(x, y, **FIT)
    assert len(model.optimizer.variables) == 2 + 2 * 2  # the head's kernel, bias
    model.get_layer("base").trainable = True
    before = model.get_layer("base").get_weights()
    engine.fit(x, y, **FIT)
    assert len(model.optimizer.variables) == 2 + 2 * 4
    assert not np.allclose(before[0], model.get_layer("base").get_weights()[0])

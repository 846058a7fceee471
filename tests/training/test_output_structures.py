"""Outputs as a model's structure gives them and losses as compile maps them
onto it, against Keras' own fit on one device: a one-output dict given one
target, two dict keys naming one tensor, and a dict of losses naming an
output the model lacks (refused before any update, in Keras' words and of the
type Keras' fit raises)."""

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

FIT = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)


def data(examples=11):
    rng = np.random.default_rng(5)
    x = rng.random((examples, 3)).astype("float32")
    return x, rng.random((examples, 1)).astype("float32")


def compiled(outputs, loss, metrics=None):
    """A model on one input whose outputs are ``outputs(dense)``, compiled
    with SGD and ``loss``."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1, name="output_a")(inputs)
    model = keras.Model(inputs, outputs(dense))
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=metrics)
    return model


def assert_trains_as_keras(build, x, y):
    engine = Towers(build(), devices=devices(3))
    reference = build()

    history = engine.fit(x, y, **FIT).history
    expected = reference.fit(x, y, **FIT).history

    assert sorted(history) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=EQUIVALENCE_RTOL)
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )
    return history


@pytest.mark.parametrize(
    "loss", ["mse", ["mse"], {"output_a": "mse"}], ids=["one", "list", "dict"]
)
def test_a_one_output_dict_given_one_target_trains_as_keras(loss):
    def build():
        return compiled(
            lambda dense: {"output_a": dense}, loss, metrics={"output_a": ["mae"]}
        )

    history = assert_trains_as_keras(build, *data())
    assert sorted(history) == ["loss", "mae"]


def test_two_dict_keys_naming_one_tensor_each_take_their_loss():
    def build():
        return compiled(
            lambda dense: {"output_a": dense, "output_b": dense},
            {"output_a": "mse", "output_b": "mae"},
        )

    x, y = data()
    history = assert_trains_as_keras(build, x, (y, y * 2))
    assert sorted(history) == ["loss", "output_a_loss", "output_b_loss"]


@pytest.mark.parametrize(
    "structure,error,keras_words",
    [
        (lambda d: [d, d * 2], ValueError, "Expected keys"),
        (
            lambda d: {"output_a": d, "output_b": d * 2},
            KeyError,
            "can't be found in either the model's output",
        ),
    ],
    ids=["list", "dict"],
)
def test_a_loss_naming_an_output_the_model_lacks_is_refused_in_keras_words(
    structure, error, keras_words
):
    model = compiled(structure, {"output_a": "mse", "output_c": "mae"})
    before = model.get_weights()
    x, y = data()

    with pytest.raises(error) as raised:
        Towers(model, devices=devices(2)).fit(x, (y, y), **FIT)

    message = str(raised.value)
    assert "received ['output_c']" in message and keras_words in message, message
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)

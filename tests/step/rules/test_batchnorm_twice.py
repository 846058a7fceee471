"""A BatchNormalization layer called more than once in a step (a siamese
network's shared embedding) moves its moving statistics at each call, in
call order, as Keras' fit does on one device (towers/step/rules/batchnorm.py)."""

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)


def siamese():
    keras.utils.set_random_seed(4)
    embed = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6),
         keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(3)]
    )  # fmt: skip
    left, right = keras.Input((4,)), keras.Input((4,))
    distance = keras.ops.mean(keras.ops.abs(embed(left) - embed(right)), 1, True)
    model = keras.Model([left, right], distance)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def data():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((29, 4)), rng.standard_normal((29, 4)) + 1.0], (
        rng.random((29, 1))
    )


@pytest.mark.parametrize(
    "num_towers, statistics", [(3, "global"), (1, "tower"), (1, "global")]
)
def test_a_layer_called_twice_moves_its_statistics_as_keras(num_towers, statistics):
    x, y = data()
    engine = Towers(siamese(), devices=devices(num_towers), batch_statistics=statistics)
    reference = siamese()
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=1e-10, atol=1e-12,
            err_msg=want.path,
        )  # fmt: skip
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-10
    )


def test_under_tower_statistics_each_call_moves_them_from_every_towers_moments():
    # Each call's statistic is the towers' moments combined (the batch's, by
    # counts): on identical shards, the same as one device's on the batch.
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    x = [np.concatenate([a, a, a]), np.concatenate([b, b, b])]
    y = np.zeros((12, 1))
    engine = Towers(siamese(), devices=devices(3), batch_statistics="tower")
    reference = siamese()
    engine.fit(x, y, batch_size=12, epochs=1, verbose=0)
    reference.fit(x, y, batch_size=12, epochs=1, verbose=0)
    for name in ("moving_mean", "moving_variance"):
        [got] = [v for v in engine.model.variables if v.path.endswith(name)]
        [want] = [v for v in reference.variables if v.path.endswith(name)]
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)

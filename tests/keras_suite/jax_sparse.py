"""jax's sparse arrays (``BCOO``) as ``x``, as Keras' TensorFlow trainer takes
them, against Keras' own fit, evaluate and predict on one device. jax is not
in the project's environment: ``make keras-tests`` runs this file (named so
that ``make test`` does not collect it) with the jax it installs beside the
environment, and the root conftest's logical CPUs."""

import jax.experimental.sparse as jax_sparse
import keras
import numpy as np

from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from tests.training.test_sparse_inputs import Subclassed
from towers import Towers

FIT = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)


def data():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((10, 5)) * (rng.random((10, 5)) < 0.4)
    x = jax_sparse.BCOO.fromdense(dense.astype("float32"))
    return x, rng.standard_normal((10, 3)).astype("float32")


def model():
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((5,), sparse=True), keras.layers.Dense(3)])
    net.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return net


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_a_jax_sparse_x_trains_evaluates_and_predicts_as_keras():
    x, y = data()  # batches of 4, 4, 2: the last uneven on 3 towers
    engine = Towers(model(), devices=[f"/cpu:{t}" for t in range(3)])
    reference = model()

    history = engine.fit(x, y, **FIT).history
    expected = reference.fit(x, y, **FIT).history

    assert sorted(history) == sorted(expected)
    for key in expected:
        assert_close(history[key], expected[key])
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        assert_close(got, want)
    assert_close(engine.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))
    assert_close(
        engine.predict(x, batch_size=4, verbose=0),
        reference.predict(x, batch_size=4, verbose=0),
    )


def test_jax_sparse_batches_from_a_generator_train_and_evaluate_as_keras():
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((10, 5)) * (rng.random((10, 5)) < 0.4)).astype("f4")
    y = rng.standard_normal((10, 3)).astype("float32")

    def batches():
        for start in (0, 4, 8):  # 4, 4, 2: the last uneven on 3 towers
            part = jax_sparse.BCOO.fromdense(dense[start : start + 4])
            yield part, y[start : start + 4]

    def build():
        keras.utils.set_random_seed(1)
        net = Subclassed()
        net.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
        return net

    engine = Towers(build(), devices=[f"/cpu:{t}" for t in range(3)])
    reference = build()
    history = engine.fit(batches(), verbose=0).history
    expected = reference.fit(batches(), verbose=0).history
    for key in expected:
        assert_close(history[key], expected[key])
    assert_close(
        engine.evaluate(batches(), verbose=0), reference.evaluate(batches(), verbose=0)
    )

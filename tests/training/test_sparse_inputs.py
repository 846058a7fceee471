"""Sparse and ragged input, split over the towers by rows: a
``tf.SparseTensor``, a SciPy sparse matrix and a ``tf.RaggedTensor`` as ``x``
of fit, evaluate and predict, against Keras' own calls (issue 39, item 11)."""

import keras
import numpy as np
import pytest
import scipy.sparse
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.split import split_batch


def assert_close(got, want, name=""):
    np.testing.assert_allclose(
        got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
    )


class Pool(keras.layers.Layer):
    """Each ragged row's mean and largest value."""

    def call(self, rows):
        return tf.stack(
            [tf.reduce_mean(rows, axis=1), tf.reduce_max(rows, axis=1)], axis=1
        )


def dense_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])


def ragged_model():
    inputs = keras.Input((None,), ragged=True)
    return keras.Model(inputs, keras.layers.Dense(3)(Pool()(inputs)))


def data(form, count=21):
    rng = np.random.default_rng(4)
    y = rng.standard_normal((count, 3)).astype("float32")
    if form == "ragged":
        lengths = rng.integers(1, 6, count)
        rows = [rng.standard_normal(n).astype("float32") for n in lengths]
        return tf.ragged.constant(rows), y
    x = rng.standard_normal((count, 6)).astype("float32")
    x[rng.random(x.shape) < 0.6] = 0.0
    if form == "scipy":
        return scipy.sparse.csr_matrix(x), y
    return tf.sparse.from_dense(x), y


@pytest.mark.parametrize("form", ["sparse", "scipy", "ragged"])
def test_sparse_and_ragged_input_train_evaluate_and_predict_as_keras(form):
    build = ragged_model if form == "ragged" else dense_model
    keras.utils.set_random_seed(0)
    mine, model = build(), build()
    model.set_weights(mine.get_weights())
    for m in (mine, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    engine = Towers(mine, devices=devices(3))
    x, y = data(form)

    options = dict(batch_size=8, epochs=2, verbose=0, shuffle=False)
    got, want = engine.fit(x, y, **options), model.fit(x, y, **options)
    for name in want.history:
        assert_close(got.history[name], want.history[name], name)
    for var, theirs in zip(mine.weights, model.weights):
        assert_close(var.numpy(), theirs.numpy(), var.path)
    assert_close(engine.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0))
    assert_close(
        engine.predict(x, batch_size=5, verbose=0), model.predict(x, verbose=0)
    )
    # Shuffled, the rows still go together with their targets.
    shuffled = engine.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(shuffled.history["loss"][0])


@pytest.mark.parametrize("form", ["sparse", "ragged"])
def test_a_sparse_or_ragged_batch_splits_by_rows_in_order(form):
    x, _ = data(form, count=7)
    shards = split_batch(x, 3)
    dense = tf.sparse.to_dense if form == "sparse" else lambda r: r.to_tensor(-1.0)
    rows = [dense(s).numpy() for s in shards]
    assert [len(r) for r in rows] == [3, 2, 2]
    whole = dense(x).numpy()
    width = whole.shape[1]
    pad = lambda r: np.pad(r, [(0, 0), (0, width - r.shape[1])], constant_values=-1)  # noqa: E731
    np.testing.assert_array_equal(np.concatenate([pad(r) for r in rows]), whole)


class Subclassed(keras.Model):
    """A model with no symbolic input, built from the first batch it sees."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_scipy_sparse_batches_from_a_generator_train_and_evaluate_as_keras():
    x, y = data("scipy", 16)

    def batches():
        for start in range(0, 16, 5):  # 5, 5, 5, 1: uneven on 3 towers
            yield x[start : start + 5], y[start : start + 5]

    def build():
        keras.utils.set_random_seed(0)
        model = Subclassed()
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
        return model

    engine, reference = Towers(build(), devices=devices(3)), build()
    history = engine.fit(batches(), verbose=0).history
    expected = reference.fit(batches(), verbose=0).history
    for key in expected:
        assert_close(history[key], expected[key], key)
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        assert_close(got, want)
    assert_close(
        engine.evaluate(batches(), verbose=0), reference.evaluate(batches(), verbose=0)
    )


def embedding_model():
    return keras.Sequential(
        [keras.Input((4,), dtype="int32"), keras.layers.Embedding(5, 3),
         keras.layers.Flatten(), keras.layers.Dense(3)]
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["sparse x", "repeated ids"])
def test_adagrad_squares_each_slice_as_one_device_does(kind):
    # A sparse x times a kernel sums each column's uses into one slice on one
    # device (its indices are a Unique's), so rows of two towers that share a
    # column must be summed before Adagrad squares them; an Embedding's gather
    # keeps a slice per use, and so must towers.
    rng = np.random.default_rng(1)
    if kind == "sparse x":  # a subclass: a Functional model would densify x
        build, (x, y) = Subclassed, data("sparse", 16)
    else:
        build = embedding_model
        x = rng.integers(0, 5, (16, 4)).astype("int32")
        y = rng.standard_normal((16, 3)).astype("float32")
    mine, model = [keras.utils.set_random_seed(0) or build() for _ in range(2)]
    for m in (mine, model):  # a subclass builds on its first batch, alike
        m.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
    engine = Towers(mine, devices=devices(2))

    options = dict(batch_size=8, epochs=2, verbose=0, shuffle=False)
    got, want = engine.fit(x, y, **options), model.fit(x, y, **options)

    assert_close(got.history["loss"], want.history["loss"])
    for var, theirs in zip(engine.optimizer.variables, model.optimizer.variables):
        assert_close(var.numpy(), theirs.numpy(), var.path)  # the accumulators
    for var, theirs in zip(mine.weights, model.weights):
        assert_close(var.numpy(), theirs.numpy(), var.path)

"""A loss that gives one value for the batch, not one per example (a
keras.losses.Loss that overrides __call__, as Keras' layer-test harness
compiles one; a function that returns the batch's mean or sum) trains as
Keras' own fit on one device: Keras' compute_loss of the whole batch,
gathered from the towers. Float64, uneven shards."""

import keras
import numpy as np
import pytest
from keras import ops

from tests.test_equivalence import devices
from tests.tolerances import ADAM_EPSILON, FLOAT64_UPDATE_RTOL
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=10, epochs=2, shuffle=False, verbose=0)


class BatchMeanSquared(keras.losses.Loss):
    """Overrides ``__call__``: the batch's mean squared error, one value."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return ops.mean(ops.square(y_true - y_pred))


class BatchSumAbsolute(keras.losses.Loss):
    """Overrides ``__call__``: a sum over the batch, which one tower's share
    of cannot give (it couples the towers' examples by their count)."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return 0.1 * ops.sum(ops.abs(y_true - y_pred))


def batch_mean_log_cosh(y_true, y_pred):
    """A function returning the batch's mean, not one value per example."""
    return ops.mean(ops.log(ops.cosh(y_pred - y_true)))


def model(loss, outputs=1):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    heads = [keras.layers.Dense(2, name=f"out{i}")(hidden) for i in range(outputs)]
    built = keras.Model(inputs, heads if outputs > 1 else heads[0])
    built.compile(
        optimizer=keras.optimizers.Adam(0.05, epsilon=ADAM_EPSILON),
        loss=loss,
        metrics=None if outputs > 1 else ["mae"],
    )
    return built


def data(outputs=1):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((23, 5))  # batches 10, 10, 3: uneven on 3 towers
    ys = [rng.standard_normal((23, 2)) for _ in range(outputs)]
    return x, ys if outputs > 1 else ys[0]


def fit_both(loss, outputs=1, num_towers=3):
    x, y = data(outputs)
    engine = Towers(model(loss, outputs), devices=devices(num_towers))
    reference = model(loss, outputs)
    before = [v.numpy() for v in reference.trainable_variables]
    history = engine.fit(x, y, **FIT).history
    expected = reference.fit(x, y, **FIT).history
    for ours, theirs, b in zip(
        engine.model.trainable_variables, reference.trainable_variables, before
    ):
        np.testing.assert_allclose(
            ours.numpy() - b, theirs.numpy() - b, rtol=FLOAT64_UPDATE_RTOL, atol=1e-12
        )
    assert history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-9)
    scores = [
        run.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
        for run in (engine, reference)
    ]
    for key in scores[1]:
        np.testing.assert_allclose(scores[0][key], scores[1][key], rtol=1e-9)
    return engine


@pytest.mark.parametrize(
    "loss",
    [BatchMeanSquared(), BatchSumAbsolute(), batch_mean_log_cosh],
    ids=["call-mean", "call-sum", "function-mean"],
)
def test_a_loss_of_one_value_for_the_batch_trains_as_keras_fit(loss):
    engine = fit_both(loss)
    # Keras' compute_loss of the whole batch, gathered from the towers.
    assert engine.step.builtin.own_loss and engine.step.builtin.coupled.gathered


def test_one_outputs_loss_of_one_value_beside_a_per_example_one():
    fit_both({"out0": BatchSumAbsolute(), "out1": "mse"}, outputs=2)

"""The model's own metrics, from every tower's predictions
(towers/step/metrics.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.step.metrics import Metrics


def compiled(metrics):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
    model.compile(loss="sparse_categorical_crossentropy", metrics=metrics)
    return model


def built(model, y, logits):
    metrics = Metrics(lambda: model, "/cpu:0")
    metrics.build(np.zeros((len(y), 3), "float32"), y)
    return metrics


def test_metrics_of_the_towers_predictions_equal_the_whole_batchs():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 9)
    logits = rng.standard_normal((9, 3)).astype("float32")
    model = compiled(["sparse_categorical_accuracy"])
    metrics = built(model, y, logits)

    # Three towers' predictions in tower order, uneven.
    metrics.update(None, y, [logits[:4], logits[4:7], logits[7:]])

    # Check equivalence with the whole batch, computed by hand.
    accuracy = np.mean(np.argmax(logits, axis=1) == y)
    results = metrics.results()
    assert float(results["sparse_categorical_accuracy"]) == pytest.approx(accuracy)
    assert list(results) == ["loss", "sparse_categorical_accuracy"]
    # The model's own objects: Keras' get_metrics_result says the same.
    assert float(model.get_metrics_result()["sparse_categorical_accuracy"]) == float(
        results["sparse_categorical_accuracy"]
    )


def test_the_loss_is_a_mean_weighted_by_each_batchs_examples():
    model = compiled(None)
    metrics = Metrics(lambda: model, "/cpu:0")
    metrics.track(tf.constant(1.0), 3, outputs={})
    metrics.track(tf.constant(3.0), 1, outputs={})
    # (1 * 3 + 3 * 1) / 4 examples, as Keras' fit reports an epoch's loss.
    assert float(metrics.loss_tracker.result()) == pytest.approx(1.5)
    assert metrics.loss_tracker is model.metrics[0]


def test_changes_summed_from_two_workers_equal_one_update_on_both_shares():
    y = np.array([0, 1, 2, 1])
    logits = np.eye(3, dtype="float32")[[0, 1, 0, 0]]  # right, right, wrong, wrong
    models = [compiled(["sparse_categorical_accuracy"]) for _ in "ab"]
    mine, theirs = (built(model, y, logits) for model in models)

    # Each worker updates with its own half; the deltas are what a cluster sums.
    before, their_before = mine.snapshot(), theirs.snapshot()
    mine.update(None, y[:2], [logits[:2]])
    theirs.update(None, y[2:], [logits[2:]])
    summed = [a + b for a, b in zip(before.deltas(), their_before.deltas())]
    before.set(summed)

    # Check equivalence with one update on the whole batch.
    whole = built(compiled(["sparse_categorical_accuracy"]), y, logits)
    whole.update(None, y, [logits])
    name = "sparse_categorical_accuracy"
    assert float(mine.results()[name]) == float(whole.results()[name]) == 0.5


def test_a_metric_keras_cannot_read_is_refused_before_any_update():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=[3])
    import towers

    engine = towers.Towers(model, devices=["/cpu:0", "/cpu:1"])
    before = [w.numpy() for w in model.weights]
    with pytest.raises(ValueError, match="3"):
        engine.fit(np.ones((4, 3), "f4"), np.ones((4, 1), "f4"), verbose=0)
    for got, want in zip(model.weights, before):
        np.testing.assert_array_equal(got.numpy(), want)


class TwoHeads(keras.Model):
    """A subclassed model that returns a list of outputs: Keras names each
    output's loss tracker after its loss, not an output name."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(6, activation="tanh")
        self.heads = [keras.layers.Dense(2), keras.layers.Dense(1)]

    def call(self, x):
        hidden = self.hidden(x)
        return [head(hidden) for head in self.heads]


def two_heads():
    keras.utils.set_random_seed(2)
    model = TwoHeads()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=["mse", "mae"], loss_weights=[1, 0.5]
    )
    model(np.zeros((1, 4), "float32"))
    return model


def test_a_list_of_outputs_named_by_their_losses_trains_and_logs_as_keras():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((13, 4)).astype("float32")
    y = [rng.standard_normal((13, 2)), rng.standard_normal((13, 1))]
    engine = Towers(two_heads(), devices=devices(2))
    reference = two_heads()
    fit = dict(batch_size=5, epochs=2, shuffle=False, verbose=0)

    history = engine.fit(x, y, **fit).history
    expected = reference.fit(x, y, **fit).history

    assert sorted(history) == sorted(expected) == ["loss", "mae_loss", "mse_loss"]
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=EQUIVALENCE_RTOL)
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )

"""The loss tracker and metrics, from every tower's predictions
(towers/step/metrics.py)."""

import numpy as np
import pytest
import tensorflow as tf

from towers.step.metrics import Metrics


def test_metrics_of_the_towers_predictions_equal_the_whole_batchs():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 9)
    logits = rng.standard_normal((9, 3)).astype("float32")
    metrics = Metrics(["sparse_categorical_accuracy"], "/cpu:0")

    # Three towers' predictions in tower order, uneven.
    metrics.update(y, [logits[:4], logits[4:7], logits[7:]])

    # Check equivalence with the whole batch, computed by hand.
    accuracy = np.mean(np.argmax(logits, axis=1) == y)
    assert float(metrics.metrics[0].result()) == pytest.approx(accuracy)
    assert set(metrics.results()) == {"sparse_categorical_accuracy"}


def test_the_loss_is_a_mean_weighted_by_each_batchs_examples():
    metrics = Metrics([], "/cpu:0")
    metrics.track_loss(tf.constant(1.0), 3)
    metrics.track_loss(tf.constant(3.0), 1)
    # (1 * 3 + 3 * 1) / 4 examples, as Keras' fit reports an epoch's loss.
    assert float(metrics.loss_tracker.result()) == pytest.approx(1.5)


def test_changes_summed_from_two_workers_equal_one_update_on_both_shares():
    y = np.array([0, 1, 2, 1])
    logits = np.eye(3, dtype="float32")[[0, 1, 0, 0]]  # right, right, wrong, wrong
    mine, theirs = (Metrics(["sparse_categorical_accuracy"], "/cpu:0") for _ in "ab")

    # Each worker updates with its own half; the deltas are what a cluster sums.
    changes = mine.update_changes(y[:2], [logits[:2]])
    their_changes = theirs.update_changes(y[2:], [logits[2:]])
    summed = [a + b for a, b in zip(changes.deltas, their_changes.deltas)]
    mine.set_changes(changes, summed)

    # Check equivalence with one update on the whole batch.
    whole = Metrics(["sparse_categorical_accuracy"], "/cpu:0")
    whole.update(y, [logits])
    assert float(mine.metrics[0].result()) == float(whole.metrics[0].result()) == 0.5


def test_unknown_metric_is_refused_with_what_was_received():
    with pytest.raises(ValueError, match="received 3"):
        Metrics([3], "/cpu:0")

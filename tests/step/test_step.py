"""The data path phase by phase (towers/step/step.py): the phases composed by hand
give the step's update; who works when a batch is small or empty."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import build_mlp, regression_batch
from tests.test_equivalence import devices
from towers import Towers


def engine_with(num_towers, **options):
    return Towers(
        build_mlp,
        "mse",
        lambda: keras.optimizers.SGD(0.1),
        devices=devices(num_towers),
        **options,
    )


def test_phases_composed_by_hand_give_the_steps_update():
    whole, by_hand = engine_with(3), engine_with(3)
    by_hand.model.set_weights(whole.model.get_weights())
    x, y = regression_batch(np.random.default_rng(0), 7)

    logs = whole.train_step(x, y)

    # Manually walk the data path: split, towers, combine, apply.
    step = by_hand.step
    x_t, y_t, _ = by_hand.prepare(x, y)

    @tf.function
    def walk():
        shards = step.split(x_t, y_t)
        towers = step.compute(shards)
        loss = step.sum_losses([r.loss for r in towers])
        grads = step.combine([r.grads for r in towers])
        variables = [r.variables for r in towers]
        weight = tf.cast(shards.size, tf.float32)  # a mean: the step's examples
        step.apply(grads, variables, [r.moments for r in towers], weight)
        return loss, shards.sizes

    loss, sizes = walk()

    # Check equivalence.
    assert sizes == [3, 2, 2]
    np.testing.assert_allclose(float(loss), float(logs["loss"]), rtol=1e-6)
    for mine, theirs in zip(by_hand.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_array_equal(mine, theirs)
    assert by_hand.steps_done == whole.steps_done == 1


@pytest.mark.parametrize(
    "placement, working",
    [("central", [0, 1]), ("replicated", [0, 1, 2, 3])],
)
def test_towers_without_examples_join_only_under_copies(placement, working):
    engine = engine_with(4, placement=placement)
    x, y, _ = engine.prepare(*regression_batch(np.random.default_rng(1), 2))

    shards = engine.step.split(x, y)

    assert shards.sizes == [1, 1, 0, 0]
    assert engine.placement.working_towers(shards) == working


def test_an_empty_share_runs_tower_0_with_zero_loss_and_gradients():
    # Only a worker of a cluster gets one: it still joins the step, with zeros.
    engine = engine_with(2)
    engine.prepare(*regression_batch(np.random.default_rng(2), 2))  # builds
    x, y = np.zeros((0, 6), "float32"), np.zeros((0, 2), "float32")

    shards = engine.step.split(tf.constant(x), tf.constant(y))
    towers = engine.step.compute(shards)

    assert shards.working() == [0] and shards.normaliser == 1
    assert len(towers) == 1 and float(towers[0].loss) == 0.0
    for grad in towers[0].grads:
        np.testing.assert_array_equal(tf.convert_to_tensor(grad).numpy(), 0.0)


def test_every_step_counts_once_whether_applied_accumulated_or_skipped():
    engine = engine_with(2, accumulate_steps=2, on_nonfinite="skip")
    rng = np.random.default_rng(3)
    x, y = regression_batch(rng, 5)
    bad = x.copy()
    bad[0, 0] = np.nan

    engine.train_step(x, y)  # accumulated
    engine.train_step(x, y)  # applied: the window is full
    engine.train_step(bad, y)  # accumulated, not finite
    engine.train_step(x, y)  # the window's sum is not finite: skipped

    assert engine.steps_done == 4
    assert int(engine.optimizer.iterations.numpy()) == 1

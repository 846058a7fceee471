"""BatchNormalization moving statistics: each policy gives exactly what it says."""

import keras
import numpy as np
import pytest

from tests.models import step_graph
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers, split_sizes

MOMENTUM = 0.5  # large steps toward the batch statistics, so errors show


def bn_first(input_shape):
    """BatchNormalization sees x itself, so the expected moments come from x."""
    return lambda: keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.BatchNormalization(momentum=MOMENTUM),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def make_engine(input_shape, num_towers, policy, seed=0):
    keras.utils.set_random_seed(seed)
    return Towers(
        bn_first(input_shape),
        "mse",
        lambda: keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        moving_statistics=policy,
        batch_statistics="tower",  # each policy moves from the towers' own
    )


def expected_statistics(x, num_towers, policy):
    """NumPy moments per channel (last axis) under the policy."""
    axes = tuple(range(x.ndim - 1))
    sizes = split_sizes(len(x), num_towers)
    shards = [s for s in np.split(x, np.cumsum(sizes)[:-1]) if len(s)]
    if policy == "batch":
        return x.mean(axes), x.var(axes)
    if policy == "tower0":
        return shards[0].mean(axes), shards[0].var(axes)
    return (
        np.mean([s.mean(axes) for s in shards], axis=0),
        np.mean([s.var(axes) for s in shards], axis=0),
    )


def bn_layer(engine):
    return engine.moving_statistics.layers[0]


@pytest.mark.parametrize("policy", ["batch", "tower0", "mean"])
@pytest.mark.parametrize("input_shape", [(5,), (4, 4, 3)], ids=["dense", "spatial"])
@pytest.mark.parametrize("num_towers,batch", [(3, 10), (4, 16), (8, 5)])
def test_moving_statistics_after_two_steps_follow_the_policy(
    policy, input_shape, num_towers, batch
):
    rng = np.random.default_rng(1)
    engine = make_engine(input_shape, num_towers, policy)
    layer = bn_layer(engine)
    mean, variance = layer.moving_mean.numpy(), layer.moving_variance.numpy()

    for _ in range(2):
        # Shifted and scaled per channel, so every statistic is far from 0 and 1.
        x = (rng.standard_normal((batch, *input_shape)) * 3 + 2).astype("float32")
        y = rng.standard_normal((batch, 2)).astype("float32")
        engine.train_step(x, y)
        step_mean, step_variance = expected_statistics(x, num_towers, policy)
        mean = mean * MOMENTUM + step_mean * (1 - MOMENTUM)
        variance = variance * MOMENTUM + step_variance * (1 - MOMENTUM)

    tolerance = dict(rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, **tolerance)
    np.testing.assert_allclose(layer.moving_variance.numpy(), variance, **tolerance)


@pytest.mark.parametrize("policy", ["batch", "tower0", "mean"])
def test_one_tower_updates_as_keras_does(policy):
    x = np.random.default_rng(2).standard_normal((12, 4, 4, 3)).astype("float32") + 1
    y = np.zeros((12, 2), "float32")
    engine = make_engine((4, 4, 3), 1, policy)
    keras_model = keras.models.clone_model(engine.model)
    keras_model.set_weights(engine.model.get_weights())

    engine.train_step(x, y)
    keras_model(x, training=True)  # Keras' own moving-statistic update

    reference = keras_model.layers[0]
    for mine, theirs in [
        (bn_layer(engine).moving_mean, reference.moving_mean),
        (bn_layer(engine).moving_variance, reference.moving_variance),
    ]:
        np.testing.assert_allclose(
            mine.numpy(), theirs.numpy(), rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_towers_assign_no_moving_statistic_only_the_apply_does():
    engine = make_engine((5,), 4, "batch")
    x, y = np.ones((8, 5), "float32"), np.zeros((8, 2), "float32")
    engine.train_step(x, y)
    graph = step_graph(engine, x, y)

    # The moving statistics' handles inside the graph (its captures of them).
    layer = bn_layer(engine)
    handles = {id(v.value.handle) for v in (layer.moving_mean, layer.moving_variance)}
    captured = {inner.name for outer, inner in graph.captures if id(outer) in handles}
    # (op name, name of the variable handle it writes), for every assignment.
    assigns = [
        (op.name, op.inputs[0].name)
        for op in graph.get_operations()
        if op.type == "AssignVariableOp"
    ]
    moving = [name for name, handle in assigns if handle in captured]
    # Exactly one assign per moving statistic, in the apply, none in the towers.
    assert len(moving) == 2 and all(n.startswith("apply/") for n in moving), assigns


def test_evaluate_leaves_moving_statistics_alone():
    engine = make_engine((5,), 2, "batch")
    before = [v.numpy() for v in engine.model.non_trainable_variables]
    engine.evaluate_step(np.ones((4, 5), "float32") * 7, np.zeros((4, 2), "float32"))
    for a, b in zip(before, engine.model.non_trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"one of \['batch', 'tower0', 'mean'\]"):
        make_engine((5,), 2, "sync")

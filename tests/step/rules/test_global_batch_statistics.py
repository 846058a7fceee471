"""batch_statistics="global": T towers train a BatchNormalization model to one
device's weights and moving statistics (towers/step/run/turns.py,
towers/step/rules/batchnorm.py).
"""

import keras
import numpy as np
import pytest

from tests.tolerances import (
    ADAM_EPSILON,
    EQUIVALENCE_ATOL,
    EQUIVALENCE_RTOL,
    MIXED_FLOAT16_CONV_RTOL,
    MIXED_FLOAT16_RTOL,
)
from towers import Towers, split_sizes
from towers.step.rules import batch_moments

STEPS = 3


def bn_mlp():
    # No bias before a BatchNormalization layer: its gradient is zero on one
    # device, and Adam would turn rounding noise around zero into full steps.
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.ReLU(),
            keras.layers.Dense(6, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5, center=False),
            keras.layers.Dense(1),
        ]
    )


def bn_cnn():
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.ReLU(),
            keras.layers.Conv2D(3, 3, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5, scale=False),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )


MODELS = {
    "mlp": (bn_mlp, (5,), "mse", 1),
    "cnn": (bn_cnn, (6, 6, 2), "sparse_categorical_crossentropy", 3),
}


def scaled_sgd():
    # For mixed_float16, a loss scale no gradient here overflows at: on one
    # device a float16 gradient sums the whole batch and can overflow where a
    # tower's shard does not, and a step one skips and the other applies is no
    # rounding difference.
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=64.0
    )


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON),
    "scaled_sgd": scaled_sgd,
}


def data(model, examples, seed=0):
    _, shape, _, outputs = MODELS[model]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((examples, *shape)) * 3 + 1).astype("float32")
    if outputs == 1:
        return x, rng.standard_normal((examples, 1)).astype("float32")
    return x, rng.integers(0, outputs, examples).astype("int32")


def trained(model, optimizer, num_towers, statistics, examples, **options):
    """Every variable (weights and moving statistics) after STEPS steps;
    ``options``: more of ``Towers``' arguments."""
    build, _, loss, outputs = MODELS[model]
    keras.utils.set_random_seed(1)
    if outputs > 1:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = Towers(
        build,
        loss,
        OPTIMIZERS[optimizer],
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        batch_statistics=statistics,
        **options,
    )
    for step in range(STEPS):
        engine.train_step(*data(model, examples, seed=step))
    if isinstance(engine.optimizer, keras.optimizers.LossScaleOptimizer):
        assert int(engine.optimizer.iterations.numpy()) == STEPS  # none skipped
    # In the model's order (Keras numbers the layers' names per build).
    return [(v.path.split("/")[-1], v.numpy()) for v in engine.model.variables]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_towers, examples", [(2, 13), (3, 13), (4, 7), (8, 5)])
def test_global_statistics_train_as_one_device(model, optimizer, num_towers, examples):
    one = trained(model, optimizer, 1, "tower", examples)
    towers = trained(model, optimizer, num_towers, "global", examples)
    sizes = split_sizes(examples, num_towers)
    assert len(set(sizes)) > 1  # uneven shards...
    if num_towers == 8:
        assert sizes.count(0) == 3  # ...and towers with no examples
    assert "moving_variance" in [name for name, _ in one]
    for (name, value), (_, mine) in zip(one, towers, strict=True):
        np.testing.assert_allclose(
            mine, value, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
        )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_global_statistics_accumulate_as_one_device(model):
    # Two micro-batches a window: each is normalised with its own whole batch's
    # statistics, as one device accumulating the same two would.
    one = trained(model, "adam", 1, "tower", 13, accumulate_steps=2)
    towers = trained(model, "adam", 3, "global", 13, accumulate_steps=2)
    plain = trained(model, "adam", 1, "tower", 13)
    assert not np.allclose(plain[0][1], one[0][1], rtol=1e-3)  # a window applied
    for (name, value), (_, mine) in zip(one, towers, strict=True):
        np.testing.assert_allclose(
            mine, value, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
        )


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_global_statistics_in_mixed_precision_train_as_one_device(model, mixed_float16):
    # The moments are float32 (Keras casts float16 inputs up), so only the
    # layers' 16-bit sums round differently on shards: compare each variable's
    # change, relative to its size, as tests/step/test_mixed_precision.py does.
    keras.utils.set_random_seed(1)
    start = [v.numpy() for v in MODELS[model][0]().variables]
    runs = {
        (num_towers, statistics): trained(
            model, "scaled_sgd", num_towers, statistics, 13
        )
        for num_towers, statistics in [(1, "tower"), (4, "global"), (4, "tower")]
    }
    one = runs[1, "tower"]
    rtol = MIXED_FLOAT16_CONV_RTOL if model == "cnn" else MIXED_FLOAT16_RTOL

    def error(run, v):
        change = one[v][1] - start[v]
        return np.linalg.norm(runs[run][v][1] - one[v][1]) / np.linalg.norm(change)

    for v, (name, value) in enumerate(one):
        assert value.dtype == np.float32  # float32 variables
        assert error((4, "global"), v) <= rtol, name
    # Each shard's own statistics are further off than 16-bit rounding.
    assert error((4, "tower"), 0) > 10 * rtol


@pytest.mark.parametrize("length", [4, 5], ids=["square", "oblong"])
def test_global_statistics_normalise_any_axis(length):
    # BatchNormalization(axis=1) on [N, 4 channels, L]: the statistics are
    # taken over N and L. With L == 4, a mean of shape [4] would broadcast
    # along the wrong axis without an error.
    def channels_first():
        return keras.Sequential(
            [
                keras.Input((3, length)),
                keras.layers.Permute((2, 1)),
                keras.layers.Dense(4, use_bias=False),
                keras.layers.Permute((2, 1)),
                keras.layers.BatchNormalization(axis=1, momentum=0.5),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((13, 3, length)) * 3 + 1).astype("float32")
    y = rng.standard_normal((13, 1)).astype("float32")
    runs = []
    for num_towers, statistics in [(1, "tower"), (3, "global")]:
        keras.utils.set_random_seed(1)
        engine = Towers(
            channels_first,
            "mse",
            keras.optimizers.SGD(0.1),
            devices=[f"/cpu:{t}" for t in range(num_towers)],
            batch_statistics=statistics,
        )
        for _ in range(STEPS):
            engine.train_step(x, y)
        runs.append(engine.model.get_weights())
    for value, mine in zip(*runs, strict=True):
        np.testing.assert_allclose(
            mine, value, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_tower_statistics_are_not_one_devices():
    # What "global" fixes: with each shard's own statistics the same model and
    # data train elsewhere (so the test above can tell the two apart).
    one = trained("mlp", "sgd", 1, "tower", 13)
    towers = trained("mlp", "sgd", 2, "tower", 13)
    assert one[0][0] == "kernel"
    assert not np.allclose(towers[0][1], one[0][1], rtol=1e-3)


def synchronized_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, use_bias=False),
            keras.layers.BatchNormalization(synchronized=True, name="sync_bn"),
            keras.layers.Dense(1),
        ]
    )


def variables_after(build, num_towers, width=3, **options):
    keras.utils.set_random_seed(0)
    devices = [f"/cpu:{t}" for t in range(num_towers)]
    engine = Towers(build, "mse", keras.optimizers.SGD(0.1), devices=devices, **options)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((13, width)).astype("float32")
        engine.train_step(x, x[:, :1] ** 2)
    return [v.numpy() for v in engine.model.variables]


@pytest.mark.parametrize("options", [{}, {"batch_statistics": "tower"}])
def test_keras_synchronized_layers_take_the_whole_batchs_statistics(options):
    # Keras' synchronized=True asks tf.distribute's replica context for the
    # batch's moments: under towers, the towers meet for them, whatever the
    # engine's batch_statistics (on 3 uneven shards, one device's update).
    one = variables_after(synchronized_model, 1)
    towers = variables_after(synchronized_model, 3, **options)
    for got, want in zip(towers, one, strict=True):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_by_default_batch_normalization_is_one_devices():
    one = variables_after(bn_mlp, 1, 5)
    for got, want in zip(variables_after(bn_mlp, 3, 5), one, strict=True):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_tower_with_the_whole_batch_takes_keras_own_moments(model, monkeypatch):
    # One tower and no cluster: the batch's moments are the tower's, so the
    # layer takes Keras' own (no meeting, nothing traced for one), and
    # "global" trains bit for bit as "tower" statistics; two towers meet.
    meetings = []
    own = batch_moments.moments_over_towers
    monkeypatch.setattr(
        batch_moments,
        "moments_over_towers",
        lambda *args: meetings.append(args) or own(*args),
    )
    keras_own = trained(model, "adam", 1, "tower", 7)
    one = trained(model, "adam", 1, "global", 7)
    assert meetings == []
    for (name, want), (_, got) in zip(keras_own, one, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
    trained(model, "adam", 2, "global", 7)
    assert len(meetings) >= 2  # both layers, each tower's trace


def test_an_unknown_batch_statistics_is_named():
    with pytest.raises(ValueError, match=r"batch_statistics must be one of \['tower'"):
        Towers(bn_mlp, "mse", keras.optimizers.SGD(0.1), batch_statistics="all")


def test_a_layer_masked_by_an_embedding_trains_as_one_device():
    def masked():
        return keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(10, 3, mask_zero=True),
                keras.layers.BatchNormalization(name="masked_bn"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ]
        )

    engine = Towers(
        masked,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
        moving_statistics="mean",
        batch_statistics="global",
    )
    reference = keras.models.clone_model(engine.model)
    reference.set_weights(engine.model.get_weights())
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.array([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0], [7, 8, 9, 1]], "int32")
    y = np.arange(4, dtype="float32").reshape(4, 1)
    engine.train_step(x, y)
    reference.train_on_batch(x, y)  # the padding left out of the moments
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_global_statistics_need_one_shared_model():
    with pytest.raises(ValueError, match="need the towers to share one model"):
        Towers(
            bn_mlp,
            "mse",
            lambda: keras.optimizers.SGD(0.1),
            devices=["/cpu:0", "/cpu:1"],
            placement="independent",
            batch_statistics="global",
        )


def test_the_zero_sync_floor_takes_a_batch_normalization_model():
    # placement="independent" (the floor the benches compare with): each copy
    # normalises its own shard and moves its own statistics toward it.
    def bn_first():
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(1),
            ]
        )

    engine = Towers(
        bn_first,
        "mse",
        lambda: keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
        placement="independent",
    )
    x = np.arange(15, dtype="float32").reshape(5, 3) ** 1.5
    engine.train_step(x, np.ones((5, 1), "float32"))
    bounds = np.cumsum([0, *split_sizes(5, 2)])
    for t, copy in enumerate(engine.placement.models):
        shard = x[bounds[t] : bounds[t + 1]]
        moving_mean = copy.layers[0].moving_mean.numpy()
        np.testing.assert_allclose(moving_mean, 0.5 * shard.mean(axis=0), rtol=1e-6)


def test_global_statistics_keep_each_towers_activity_regulariser():
    """A layer finds its add_loss terms by ids it clears at each call
    (``Layer._loss_ids``): traced in lockstep, the towers' calls interleave at
    every BatchNormalization, and a tower whose ids were cleared by the next
    tower's call would lose its regulariser's term."""

    def build():
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(
                    8,
                    use_bias=False,
                    activity_regularizer=keras.regularizers.L2(0.05),
                ),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(1),
            ]
        )

    def trained(num_towers, statistics):
        keras.utils.set_random_seed(1)
        engine = Towers(
            build,
            "mse",
            lambda: keras.optimizers.SGD(0.1),
            devices=[f"/cpu:{t}" for t in range(num_towers)],
            batch_statistics=statistics,
        )
        for step in range(STEPS):
            engine.train_step(*data("mlp", 13, seed=step))
        return [v.numpy() for v in engine.model.variables]

    for one, mine in zip(trained(1, "tower"), trained(3, "global"), strict=True):
        np.testing.assert_allclose(
            mine, one, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )

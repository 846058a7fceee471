"""Global batch statistics under XLA (towers/step/run/phases.py): each tower's
pass cut where the towers meet, one XLA computation per phase, exact against
Keras' own XLA fit on one device (to float32 rounding), BatchNormalization's
moving statistics included.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import step_graph
from tests.step.rules.test_global_batch_statistics import bn_cnn, bn_mlp
from tests.step.run.test_xla import BATCH, assert_close, assert_same_updates, data, fit
from tests.test_equivalence import devices
from towers import Towers
from towers.devices import canonical_device
from towers.explain.graph import xla_calls
from towers.step.run import cut, phases, seats


def residual():
    """A block with a projection shortcut, as ResNet's: the shortcut's
    BatchNormalization meets the towers in the same phases as the main
    branch's first, and on the way back in the same phase as its second."""
    inputs = keras.Input((6, 6, 2))
    main = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    main = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.5)(main))
    main = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(main)
    main = keras.layers.BatchNormalization(momentum=0.5)(main)
    shortcut = keras.layers.Conv2D(4, 1, use_bias=False)(inputs)
    shortcut = keras.layers.BatchNormalization(momentum=0.5)(shortcut)
    joined = keras.layers.ReLU()(keras.layers.Add()([main, shortcut]))
    pooled = keras.layers.GlobalAveragePooling2D()(joined)
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


MODELS = {
    "mlp": (bn_mlp, (5,), keras.losses.MeanSquaredError(), "mae"),
    "cnn": (bn_cnn, (6, 6, 2), keras.losses.SparseCategoricalCrossentropy(), "acc"),
    "residual": (
        residual,
        (6, 6, 2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "acc",
    ),
}


def compiled(build, loss, jit_compile=True, metric="mae"):
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01, epsilon=1e-3),
        loss=loss,
        metrics=[metric],
        jit_compile=jit_compile,
    )
    return model


def targets(name, y):
    if name == "mlp":
        return (y.astype("float32") - 1.0)[:, None]
    return y


@pytest.mark.parametrize(
    "name, num_towers", [("mlp", 4), ("cnn", 2), ("residual", 2), ("residual", 4)]
)
def test_global_statistics_with_xla_train_as_keras_xla_fit(
    xla_allowed, name, num_towers
):
    """37 examples in batches of 10 (uneven over 2 and 4 towers, the last
    batch 7), sample weights, Adam: every variable's update, moving statistics
    included, the loss and a metric, against Keras' fit with XLA."""
    build, shape, loss, metric = MODELS[name]
    x, y, sample_weight = data(shape)
    y = targets(name, y)
    reference = compiled(build, loss, metric=metric)
    assert reference.jit_compile is True  # Keras' fit really compiles
    before = [w.numpy() for w in reference.weights]
    want = fit(reference, x, y, sample_weight).history
    model = compiled(build, loss, metric=metric)
    engine = Towers(model, devices=devices(num_towers), batch_statistics="global")
    assert engine.step.builtin.jit.enabled
    got = fit(engine, x, y, sample_weight)
    assert_same_updates(model, reference, before)
    assert_close(got["loss"], want["loss"])
    assert_close(got[metric], want[metric])


def test_a_divisor_from_sample_weights_is_summed_between_the_phases(xla_allowed):
    """Keras' "mean_with_sample_weight" divides by the batch's sum of weights,
    which each tower's pass takes as one more sum over the towers."""
    x, y, sample_weight = data((5,))
    y = targets("mlp", y)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    reference = compiled(bn_mlp, loss)
    before = [w.numpy() for w in reference.weights]
    want = fit(reference, x, y, sample_weight).history
    model = compiled(bn_mlp, loss)
    engine = Towers(model, devices=devices(2), batch_statistics="global")
    got = fit(engine, x, y, sample_weight)
    assert_same_updates(model, reference, before)
    assert_close(got["loss"], want["loss"])


@pytest.mark.parametrize("num_towers", [2, 3])
def test_each_tower_runs_its_phases_on_its_own_device(num_towers):
    """bn_mlp's two BatchNormalization layers meet the towers twice on the way
    forward and once back: a tower's pass is seven XLA computations, each
    tower's on its own device, the sums between them outside."""
    x, y, sample_weight = data((5,))
    y = targets("mlp", y)
    engine = Towers(
        compiled(bn_mlp, "mse", jit_compile=False),
        devices=devices(num_towers),
        batch_statistics="global",
        jit_compile=True,
    )
    graph = step_graph(engine, x[:BATCH], y[:BATCH], sample_weight[:BATCH])
    calls = xla_calls(graph)
    count = len(calls) // num_towers
    assert count == 7
    for t, device in enumerate(engine.devices):
        mine = [c for c in calls if c.stage == f"tower {t} XLA"]
        assert len(mine) == count
        assert {c.device for c in mine} == {canonical_device(device)}
    sums = [op for op in graph.get_operations() if "towers_sum" in op.name]
    assert sums and all(op.type in ("AddN", "Identity", "StopGradient") for op in sums)


def test_independent_sums_share_a_phase():
    """Three BatchNormalization layers, three sums each, but the shortcut's
    meet beside the main branch's: 7 phases, not 10."""
    x, y, _ = data((6, 6, 2))
    engine = Towers(
        residual,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1),
        devices=devices(2),
        batch_statistics="global",
        jit_compile=True,
    )
    graph = step_graph(engine, x[:BATCH], y[:BATCH])
    assert [c.stage for c in xla_calls(graph)].count("tower 0 XLA") == 7


def test_a_pass_is_cut_where_the_towers_meet():
    """The cut on a pass of two sums: ``total(x)`` then ``total(x * total(x))``,
    over two towers given 1 and 2, and 3 and 4."""

    def work(x):
        first = seats.total(tf.reduce_sum(x, keepdims=True))
        return seats.total(tf.reduce_sum(x * first, keepdims=True)) + 0.5

    @tf.function(autograph=False)
    def two_towers(a, b):
        plan = cut.trace(work, (a,), jit=False)
        assert [e.phase for e in plan.meetings] == [1, 2]
        return phases.run([plan, plan], [(a,), (b,)], ["/cpu:0", "/cpu:1"], [0, 1])

    got = two_towers(tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0]))
    # total(x) = 10; the second sum: 10 * (1 + 2 + 3 + 4) = 100.
    np.testing.assert_allclose([float(g[0]) for g in got], [100.5, 100.5])


def test_random_layers_draw_as_the_same_step_without_xla(xla_allowed):
    """Dropout after BatchNormalization, each phase an XLA computation: the
    step advances the seed states as far as the same step without XLA does
    (every tower draws its rows of the batch's numbers: step/rules/draws.py)."""

    def build():
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, use_bias=False),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.3),
                keras.layers.Dense(1),
            ]
        )

    x, y, _ = data((5,))
    y = targets("mlp", y)

    def engine(jit_compile):
        keras.utils.set_random_seed(4)
        return Towers(
            build,
            "mse",
            keras.optimizers.SGD(0.01),
            devices(3),
            batch_statistics="global",
            jit_compile=jit_compile,
        )

    with_xla, without = engine(True), engine(False)
    for trainer in (with_xla, without):
        trainer.train_step(x[:BATCH], y[:BATCH])
    seeds = [
        [v.numpy() for v in t.model.variables if "seed_generator" in v.path]
        for t in (with_xla, without)
    ]
    assert seeds[0] and all(s.any() for s in seeds[0])
    for got, want in zip(*seeds):
        np.testing.assert_array_equal(got, want)

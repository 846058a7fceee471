"""One trace for every tower (towers/step/run/phases.py): when it serves, how many
functions it makes, and that the step it builds is the step a trace per tower
builds (the equivalence tests run through it: every central step does)."""

import keras
import numpy as np
import pytest

from tests.models import build_mlp, regression_batch, step_graph
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.step.run import phases

CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def engine(num_towers=3, loss="mse", **options):
    return Towers(
        build_mlp,
        loss,
        keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        **options,
    )


def tower_functions(eng, x, y, sample_weight=None):
    """Per call of a tower function in the step's graph, the function's name."""
    graph = step_graph(eng, x, y, sample_weight)
    return [
        op.get_attr("f").name
        for op in graph.get_operations()
        if op.type in CALLS and op.name.startswith("tower_")
    ]


@pytest.mark.parametrize("examples, traces", [(9, 1), (8, 2), (2, 1)])
def test_one_trace_per_shard_size(examples, traces):
    # 9 on 3 towers: 3 + 3 + 3; 8: 3 + 3 + 2; 2: 1 + 1 (tower 2 has none).
    x, y = regression_batch(np.random.default_rng(0), examples)
    calls = tower_functions(engine(), x, y)
    assert len(calls) == min(examples, 3)
    assert len(set(calls)) == traces


def test_copies_per_tower_are_traced_per_tower():
    eng = engine(placement="replicated")
    x, y = regression_batch(np.random.default_rng(0), 9)
    assert tower_functions(eng, x, y) == []


def test_a_divisor_from_sample_weights_traces_tower_by_tower_and_stays_exact():
    # Keras divides by the sample weights' sum: no tower knows it alone.
    # Without XLA the towers are traced one by one (they step faster so than
    # cut at the sum; with XLA they are cut: test_xla.py).
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    eng = engine(loss=loss)
    rng = np.random.default_rng(1)
    x, y = regression_batch(rng, 9)
    weights = rng.random(9).astype("float32")
    reference = build_mlp()
    reference.set_weights(eng.model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)

    assert tower_functions(eng, x, y, weights) == []
    eng.train_step(x, y, weights)
    reference.train_on_batch(x, y, sample_weight=weights)

    for got, want in zip(eng.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def build_dropout_mlp():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.5, seed=7),
            keras.layers.Dense(2),
        ]
    )


def dropout_engine():
    return Towers(
        build_dropout_mlp,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(3)],
    )


def seed_states(eng):
    return [np.array(v) for v in eng.model.non_trainable_variables]


def test_dropout_draws_as_a_trace_per_tower_and_no_tower_waits(monkeypatch):
    x, y = regression_batch(np.random.default_rng(2), 9)
    shared = dropout_engine()
    calls = [
        op
        for op in step_graph(shared, x, y).get_operations()
        if op.type in CALLS and op.name.startswith("tower_")
    ]
    # A seed state assigned inside the calls would chain them, tower 1's
    # waiting for tower 0's.
    assert len(calls) == 3
    assert [op.control_inputs for op in calls] == [[], [], []]

    before = seed_states(shared)
    assert len(before) == 1
    weights = shared.model.get_weights()
    shared.train_step(x, y)

    monkeypatch.setattr(phases, "shareable", lambda *args: False)
    per_tower = dropout_engine()
    per_tower.model.set_weights(weights)
    np.testing.assert_array_equal(seed_states(per_tower)[0], before[0])
    per_tower.train_step(x, y)

    after = seed_states(shared)
    assert not np.array_equal(after[0], before[0])  # the towers drew
    np.testing.assert_array_equal(after[0], seed_states(per_tower)[0])
    for got, want in zip(shared.model.get_weights(), per_tower.model.get_weights()):
        np.testing.assert_array_equal(got, want)


class Counted(keras.layers.Layer):
    """Counts its calls: each is a trace of the pass it is in."""

    calls = 0

    def call(self, inputs):
        Counted.calls += 1
        return inputs


@pytest.mark.parametrize("call", ["evaluate", "predict"])
@pytest.mark.parametrize("examples, traces", [(9, 1), (8, 2)])
def test_evaluate_and_predict_trace_once_per_shard_size(call, examples, traces):
    # 9 on 3 towers: 3 + 3 + 3; 8: 3 + 3 + 2. A trace per tower would be 3.
    eng = Towers(
        lambda: keras.Sequential([keras.Input((4,)), Counted(), keras.layers.Dense(2)]),
        "mse",
        keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(3)],
    )
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((examples, 4)), rng.standard_normal((examples, 2))
    run = getattr(eng, call)
    args = (x,) if call == "predict" else (x, y)
    run(*[a[:2] for a in args], verbose=0)  # the first call's probe and builds
    Counted.calls = 0
    run(*args, batch_size=examples, verbose=0)
    assert Counted.calls == traces


def test_a_functional_model_without_weights_is_never_called_to_build_it():
    # Built from its Input with nothing to make: Keras' predict calls it only
    # in its one trace, and so do the towers.
    inputs = keras.Input((4,))
    eng = Towers(keras.Model(inputs, Counted()(inputs)), devices=["/cpu:0", "/cpu:1"])
    Counted.calls = 0
    got = eng.predict(np.ones((6, 4)), verbose=0)
    assert Counted.calls == 1
    np.testing.assert_array_equal(got, np.ones((6, 4)))

"""Placements: where each variable lives, and that training stays exact there."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import (
    build_dense_sparse_unused,
    build_mlp,
    dense_sparse_batch,
    regression_batch,
    step_graph,
)
from tests.test_equivalence import OPTIMIZERS, devices, reference_trainer
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.placement.balance import balance
from towers.placement.base import bytes_by_device, variable_bytes

STEPS = 3


def engine_with(placement, num_towers=4, build=build_mlp, optimizer="adam", **kw):
    return Towers(
        build,
        "mse" if build is build_mlp else _sparse_loss(),
        OPTIMIZERS[optimizer],
        devices=devices(num_towers),
        placement=placement,
        **kw,
    )


def _sparse_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def ops_by_type(engine, x, y, types):
    graph = step_graph(engine, x, y)
    return [op for op in graph.get_operations() if op.type in types]


# -- balance ------------------------------------------------------------------


def test_balance_puts_largest_first_on_the_emptiest_device():
    # 400 -> A; 300 -> B; 30 -> B (300 < 400); 10 -> B (330 < 400).
    assert balance([10, 400, 30, 300], ["A", "B"]) == ["B", "A", "B", "B"]


def test_balance_ties_go_to_the_earliest_device_in_order():
    assert balance([5, 5, 5, 5], ["A", "B", "C"]) == ["A", "B", "C", "A"]


def test_balance_refuses_no_devices():
    with pytest.raises(ValueError, match=r"at least one device; received \[\]"):
        balance([1], [])


# -- balanced -----------------------------------------------------------------


def test_balanced_variables_follow_a_greedy_largest_first_plan():
    engine = engine_with("balanced", num_towers=3, build=lambda: build_mlp(6, 16, 2))
    variables = engine.model.variables
    # Sizes: kernel 6x16, bias 16, kernel 16x2, bias 2 (float32).
    sizes = [variable_bytes(v) for v in variables]
    assert sizes == [384, 64, 128, 8]
    # Independent reference: 384 -> cpu0, 128 -> cpu1, 64 -> cpu2, 8 -> cpu2.
    want = ["CPU:0", "CPU:2", "CPU:1", "CPU:2"]
    assert [v.handle.device[-5:] for v in variables] == want
    assert {d[-5:]: b for d, b in bytes_by_device(variables).items()} == {
        "CPU:0": 384,
        "CPU:2": 72,
        "CPU:1": 128,
    }


def test_balanced_slots_live_with_their_variable():
    engine = engine_with("balanced", num_towers=3)
    by_name = {
        v.path.replace("/", "_"): v.handle.device for v in engine.model.variables
    }
    slots = [v for v in engine.optimizer.variables if "momentum" in v.name]
    slots += [v for v in engine.optimizer.variables if "velocity" in v.name]
    assert len(slots) == 2 * len(by_name)
    for slot in slots:
        owner = slot.name.rsplit("_", 1)[0]
        assert slot.handle.device == by_name[owner], slot.name


def test_balanced_combine_and_update_run_on_each_variables_device():
    engine = engine_with("balanced", num_towers=3, optimizer="sgd")
    x, y = regression_batch(np.random.default_rng(0), 9)
    engine.train_step(x, y)
    # Every AddN but the reported loss's (on the variable device) sums a gradient.
    addn = [
        op for op in ops_by_type(engine, x, y, {"AddN"}) if op.name != "combine/AddN"
    ]
    updates = ops_by_type(engine, x, y, {"ResourceApplyGradientDescent"})
    variable_devices = sorted(v.handle.device[-5:] for v in engine.model.variables)
    assert sorted(op.device[-5:] for op in addn) == variable_devices
    # Keras' SGD is an AssignSub (or the fused op); either runs where its var is.
    subs = updates or ops_by_type(engine, x, y, {"AssignSubVariableOp"})
    assert sorted(op.device[-5:] for op in subs) == variable_devices


class OwnStep(keras.Sequential):
    """An MLP with its own train_step: a tape, compute_loss, one apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def own_step_mlp():
    keras.utils.set_random_seed(0)
    model = OwnStep(build_mlp().layers)
    model.compile(loss="mse", optimizer=OPTIMIZERS["adam"]())
    return model


def test_balanced_places_a_models_own_step_on_each_variables_device():
    # Its apply's sums and updates run where each variable lives, as the
    # built-in step's do, and it trains as Keras' fit on one device.
    engine = Towers(own_step_mlp, devices=devices(3), placement="balanced")
    reference = own_step_mlp()
    reference.set_weights(engine.model.get_weights())
    x, y = regression_batch(np.random.default_rng(0), 9)
    fit = dict(batch_size=9, epochs=2, verbose=0, shuffle=False)
    engine.fit(x, y, **fit)
    reference.fit(x, y, **fit)
    for got, want, var in zip(
        engine.model.get_weights(), reference.get_weights(), reference.weights
    ):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=var.path
        )
    x, y, sample_weight = engine.prepare(x, y)
    train = tf.function(engine.step.train, autograph=False)
    graph = train.get_concrete_function(x, y, sample_weight).graph
    ops = graph.get_operations()
    sums = [op for op in ops if op.type == "AddN" and op.name.startswith("combine/")]
    updates = [op for op in ops if op.name.startswith("apply/")]
    updates = [op for op in updates if op.type == "AssignSubVariableOp"]
    variable_devices = sorted(v.handle.device[-5:] for v in engine.model.variables
                              if v.trainable)  # fmt: skip
    assert len(set(variable_devices)) == 3
    assert sorted(op.device[-5:] for op in sums) == variable_devices
    # Adam's variable update is one AssignSub each, beside its slots' own.
    assert set(op.device[-5:] for op in updates) == set(variable_devices)


@pytest.mark.parametrize("placement", ["balanced", "replicated"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_placement_equals_one_device_on_the_whole_batch(placement, optimizer):
    engine = engine_with(placement, num_towers=3, optimizer=optimizer)
    reference = build_mlp()
    reference.set_weights(engine.model.get_weights())
    step = reference_trainer(
        reference, keras.losses.get("mse"), OPTIMIZERS[optimizer]()
    )
    rng = np.random.default_rng(1)
    for batch in (7, 9, 2):  # uneven, even, fewer examples than towers
        x, y = regression_batch(rng, batch)
        step(x, y)
        engine.train_step(x, y)
    assert int(engine.optimizer.iterations.numpy()) == 3
    for got, want, var in zip(
        engine.model.get_weights(), reference.get_weights(), reference.weights
    ):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=var.path
        )


# -- replicated ---------------------------------------------------------------


def test_replicated_keeps_a_copy_and_its_slots_on_every_tower():
    engine = engine_with("replicated", num_towers=4)
    assert len(engine.placement.models) == 4
    for t, (model, optimizer) in enumerate(
        zip(engine.placement.models, engine.placement.optimizers)
    ):
        slots = [v for v in optimizer.variables if v.shape.rank]
        assert len(slots) == 2 * len(model.trainable_variables)
        for var in model.variables + slots:
            assert var.handle.device.endswith(f"CPU:{t}"), (t, var.path)


@pytest.mark.parametrize("reducer, per_tower", [("per_tensor", 4), ("packed", 1)])
def test_replicated_all_reduces_once_per_tower_and_tensor_or_bucket(reducer, per_tower):
    # MLP 6-16-2: 4 small variables, one 1 MiB bucket when packed.
    engine = engine_with("replicated", num_towers=2, reducer=reducer)
    x, y = regression_batch(np.random.default_rng(0), 6)
    engine.train_step(x, y)
    collectives = ops_by_type(engine, x, y, {"CollectiveReduceV2"})
    counts = collections.Counter(op.device[-5:] for op in collectives)
    assert counts == {"CPU:0": per_tower, "CPU:1": per_tower}


def test_replicated_copies_stay_bit_identical():
    engine = engine_with("replicated", num_towers=4)
    rng = np.random.default_rng(2)
    for batch in (8, 5, 13):
        engine.train_step(*regression_batch(rng, batch))
    first = engine.placement.models[0].get_weights()
    assert not np.allclose(first[0], build_mlp().get_weights()[0])
    for model in engine.placement.models[1:]:
        for got, want in zip(model.get_weights(), first):
            np.testing.assert_array_equal(got, want)


def test_replicated_sparse_gradients_match_one_device():
    engine = engine_with(
        "replicated", num_towers=3, build=build_dense_sparse_unused, optimizer="sgd"
    )
    reference = build_dense_sparse_unused()
    reference.set_weights(engine.model.get_weights())
    step = reference_trainer(reference, _sparse_loss(), OPTIMIZERS["sgd"]())
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        x, y = dense_sparse_batch(rng, 10)
        step(x, y)
        engine.train_step(x, y)
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL, atol=1e-6)


def test_replicated_restore_brings_every_copy_to_the_checkpoint(tmp_path):
    rng = np.random.default_rng(4)
    x, y = regression_batch(rng, 12)
    trained = engine_with("replicated", num_towers=2)
    trained.fit(x, y, batch_size=4, epochs=1, verbose=0, checkpoint_dir=str(tmp_path))

    resumed = engine_with("replicated", num_towers=2)
    resumed.fit(x, y, batch_size=4, epochs=1, verbose=0, checkpoint_dir=str(tmp_path))

    # The second fit found the run complete: every copy holds the saved weights.
    assert resumed.steps_done == 3
    for model in resumed.placement.models:
        for got, want in zip(model.get_weights(), trained.model.get_weights()):
            np.testing.assert_array_equal(got, want)


# -- independent --------------------------------------------------------------


def test_independent_towers_never_communicate_and_drift_apart():
    engine = engine_with("independent", num_towers=2, optimizer="sgd")
    x, y = regression_batch(np.random.default_rng(5), 8)
    start = engine.model.get_weights()
    engine.train_step(x, y)
    # The one sum in the step is the reported loss's; no gradient is combined.
    summed = ops_by_type(engine, x, y, {"CollectiveReduceV2", "AddN"})
    assert [op.name for op in summed] == ["combine/AddN"]
    first, second = (m.get_weights() for m in engine.placement.models)
    assert not np.allclose(first[0], second[0])

    # Tower 0's copy took one SGD step on its shard alone (loss share n_0 / B).
    reference = build_mlp()
    reference.set_weights(start)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(keras.losses.get("mse")(y[:4], reference(x[:4]))) / 8
    grads = tape.gradient(loss, reference.trainable_variables)
    want = [w - 0.1 * g.numpy() for w, g in zip(start, grads)]
    for got, expected in zip(first, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# -- bad input ----------------------------------------------------------------


def test_unknown_placement_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        engine_with("mirrored")
    assert str(error.value) == (
        "unknown placement; received 'mirrored', expected one of "
        "['central', 'balanced', 'replicated', 'independent']"
    )


@pytest.mark.parametrize("placement", ["balanced", "replicated"])
def test_placement_needs_a_model_builder(placement):
    with pytest.raises(ValueError, match="model must be a zero-arg function"):
        Towers(build_mlp(), "mse", OPTIMIZERS["sgd"], placement=placement)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"accumulate_steps": 2}, "accumulate_steps > 1"),
        ({"on_nonfinite": "skip"}, "on_nonfinite='skip'"),
    ],
)
def test_replicated_refuses_what_it_does_not_support(kwargs, named):
    with pytest.raises(ValueError, match=f"does not support {named}"):
        engine_with("replicated", **kwargs)


@pytest.mark.parametrize("reducer", ["sharded", "bf16+packed"])
def test_replicated_refuses_reducers_an_all_reduce_cannot_take(reducer):
    with pytest.raises(ValueError, match=re.escape(f"received '{reducer}'")):
        engine_with("replicated", reducer=reducer)

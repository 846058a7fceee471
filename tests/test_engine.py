"""Structure and contract of the Towers engine (exactness is test_equivalence.py)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import (
    build_mlp,
    regression_batch,
    step_graph,
)
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers


def mlp_batch(batch=8, seed=0):
    return regression_batch(np.random.default_rng(seed), batch)


def snapshot(engine):
    return [
        v.numpy().copy() for v in engine.model.variables + engine.optimizer.variables
    ]


def assert_unchanged(engine, before):
    after = snapshot(engine)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def test_variables_and_optimizer_slots_live_on_the_variable_device():
    engine = Towers(
        build_mlp,
        "mse",
        keras.optimizers.Adam,
        devices=["/cpu:0", "/cpu:1"],
        variable_device="/cpu:3",
    )
    engine.train_step(*mlp_batch())

    devices = {v.path: v.handle.device for v in engine.model.variables}
    slots = {v.path: v.handle.device for v in engine.optimizer.variables}
    assert len(slots) == 2 + 2 * len(devices)  # iteration, learning rate, m and v
    for name, device in {**devices, **slots}.items():
        assert device.endswith("/device:CPU:3"), (name, device)


def test_each_tower_computes_on_its_device_and_combine_apply_on_variable_device():
    engine = Towers(
        build_mlp,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:1", "/cpu:2", "/cpu:5"],
        variable_device="/cpu:0",
    )
    # What TensorFlow placed: the towers' function, traced once, runs each
    # call's forward and backward ops on that call's device.
    report = engine.explain(*mlp_batch(9))

    for t, device in enumerate(["/device:CPU:1", "/device:CPU:2", "/device:CPU:5"]):
        # Reading a weight runs where it lives (the variable device); the rest
        # of the forward pass, and the whole backward pass, on the tower's.
        assert report.ran_on(f"tower {t} forward") == [device, "/device:CPU:0"]
        assert report.ran_on(f"tower {t} backward") == [device]
    assert report.ran_on("combine") == ["/device:CPU:0"]
    assert report.ran_on("apply") == ["/device:CPU:0"]
    graph = step_graph(engine, *mlp_batch(9))
    calls = [
        op
        for op in graph.get_operations()
        if op.type in ("PartitionedCall", "StatefulPartitionedCall")
    ]
    # One trace serves the three towers: the same function, called three times.
    assert len(calls) == 3 and len({op.get_attr("f").name for op in calls}) == 1


def test_towers_without_examples_build_no_ops():
    engine = Towers(
        build_mlp,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(4)],
    )
    graph = step_graph(engine, *mlp_batch(2))

    scopes = {op.name.split("/")[0] for op in graph.get_operations()}
    assert {"tower_0", "tower_1"} <= scopes
    assert not {"tower_2", "tower_3"} & scopes


def test_one_apply_per_step_advances_iterations_by_one():
    engine = Towers(
        build_mlp,
        "mse",
        keras.optimizers.Adam(),
        devices=[f"/cpu:{t}" for t in range(4)],
    )

    for step in range(1, 4):
        engine.train_step(*mlp_batch(seed=step))
        assert int(engine.optimizer.iterations.numpy()) == step


def test_step_traces_once_per_input_signature():
    engine = Towers(
        build_mlp, "mse", keras.optimizers.SGD(0.1), devices=["/cpu:0", "/cpu:1"]
    )

    for seed in range(4):
        engine.train_step(*mlp_batch(8, seed))
    assert engine.trace_count == 1
    engine.train_step(*mlp_batch(5))  # a new batch size is a new signature
    engine.train_step(*mlp_batch(5, seed=1))
    assert engine.trace_count == 2


def test_builder_runs_under_the_variable_device():
    engine = Towers(
        build_mlp,
        "mse",
        keras.optimizers.SGD(),
        devices=["/cpu:0"],
        variable_device="/cpu:6",
    )

    assert {v.handle.device.split("/")[-1] for v in engine.model.variables} == {
        "device:CPU:6"
    }


def test_optimizer_made_elsewhere_still_gets_its_slots_on_the_variable_device():
    optimizer = keras.optimizers.Adam()  # its iteration count lives on CPU:0
    engine = Towers(
        build_mlp, "mse", optimizer, devices=["/cpu:0"], variable_device="/cpu:6"
    )

    slots = [
        v for v in optimizer.variables if "momentum" in v.path or "velocity" in v.path
    ]
    assert len(slots) == 2 * len(engine.model.trainable_variables)
    assert {v.handle.device[-5:] for v in slots} == {"CPU:6"}


def test_lazily_built_model_is_built_on_the_variable_device():
    def build():
        return keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])

    engine = Towers(
        build,
        "mse",
        keras.optimizers.SGD,
        devices=["/cpu:0", "/cpu:1"],
        variable_device="/cpu:2",
    )
    assert not engine.model.variables
    engine.train_step(*mlp_batch())

    assert len(engine.model.variables) == 4
    assert {
        v.handle.device[-5:]
        for v in engine.model.variables + engine.optimizer.variables
    } == {"CPU:2"}


class Counting(keras.Model):
    """A subclassed model whose call moves a counter (Keras' own callback
    test's): built lazily, from the first batch."""

    def __init__(self):
        super().__init__()
        self.calls = self.add_variable(shape=(), initializer="zeros", trainable=False)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        self.calls.assign_add(1.0)
        return self.dense(inputs)


@pytest.mark.parametrize("placement", ["central", "balanced", "replicated"])
def test_a_lazily_built_models_call_runs_only_in_its_steps(placement):
    # Built from the first batch's shapes, as Keras' fit builds it, not by a
    # call that runs: after each batch the counter reads what Keras' reads.
    def counts(fit, model):
        seen = []
        read = keras.callbacks.LambdaCallback(
            on_batch_end=lambda batch, logs: seen.append(float(model.calls))
        )
        fit.fit(*mlp_batch(), batch_size=2, callbacks=[read], verbose=0)
        return seen

    reference = Counting()
    reference.compile(optimizer="sgd", loss="mse")
    engine = Towers(Counting, "mse", keras.optimizers.SGD, devices=["/cpu:0", "/cpu:1"],
                    placement=placement)  # fmt: skip

    expected = counts(reference, reference)
    assert counts(engine, engine.model) == expected == [1.0, 2.0, 3.0, 4.0]
    if placement == "balanced":  # built in place (its compile kept), by the plan
        placed = {v.handle.device[-5:] for v in engine.model.dense.weights}
        assert placed <= {"CPU:0", "CPU:1"}


def test_built_model_off_the_variable_device_is_refused():
    with tf.device("/cpu:1"):
        model = build_mlp()

    with pytest.raises(ValueError) as error:
        Towers(model, "mse", keras.optimizers.SGD(), devices=["/cpu:0"])

    message = str(error.value)
    assert "model variables must live on the variable device /device:CPU:0" in message
    assert "received 'sequential" in message and "on /job:localhost" in message
    assert message.rstrip().endswith("`with tf.device('/device:CPU:0')`.")


def test_x_and_y_with_different_batch_sizes_raise_and_change_nothing():
    engine = Towers(
        build_mlp, "mse", keras.optimizers.Adam(), devices=["/cpu:0", "/cpu:1"]
    )
    before = snapshot(engine)
    x, _ = mlp_batch(8)
    _, y = mlp_batch(7)

    with pytest.raises(ValueError, match=r"received x with 8 examples and y with 7"):
        engine.train_step(x, y)
    assert_unchanged(engine, before)


def test_loss_returning_a_mean_trains_as_keras_on_one_device():
    # One value for the batch, as Keras takes it: its compute_loss of the
    # batch (towers/step/work/losses.py's OneValue), here each tower's by share.
    def mean_squared(y, p):
        return tf.reduce_mean(tf.square(y - p))

    engine = Towers(
        build_mlp, mean_squared, keras.optimizers.SGD(0.1), devices=["/cpu:0", "/cpu:1"]
    )
    reference = build_mlp()
    reference.set_weights(engine.model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=mean_squared)
    x, y = mlp_batch(7)

    logs = engine.train_step(x, y)
    expected = reference.train_on_batch(x, y, return_dict=True)

    np.testing.assert_allclose(
        float(logs["loss"]), expected["loss"], rtol=EQUIVALENCE_RTOL
    )
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_loss_returning_too_many_values_raises():
    engine = Towers(
        build_mlp,
        lambda y, p: tf.reshape(tf.square(y - p), [-1]),
        keras.optimizers.SGD(),
        devices=["/cpu:0", "/cpu:1"],
    )

    with pytest.raises(ValueError, match=r"4 predictions gave 8 loss values"):
        engine.train_step(*mlp_batch(8))


def test_step_that_fails_at_run_time_changes_nothing():
    # The number of loss values is only known when the step runs, and is wrong.
    def positive_only(y, p):
        per_example = tf.reduce_mean(tf.square(y - p), axis=-1)
        return tf.boolean_mask(per_example, per_example > 1.0)

    engine = Towers(
        build_mlp, positive_only, keras.optimizers.Adam(), devices=["/cpu:0", "/cpu:1"]
    )
    before = snapshot(engine)

    with pytest.raises(tf.errors.InvalidArgumentError, match="one value per example"):
        engine.train_step(*mlp_batch(64))
    assert_unchanged(engine, before)


def test_loss_that_ignores_the_model_raises():
    engine = Towers(
        build_mlp,
        lambda y, p: tf.reduce_sum(y, axis=-1),
        keras.optimizers.SGD(),
        devices=["/cpu:0"],
    )

    with pytest.raises(ValueError, match=r"no trainable variable gets a gradient"):
        engine.train_step(*mlp_batch())
    assert int(engine.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"model": "resnet"},
            r"model must be a keras.Model, or a zero-argument .*received str 'resnet'",
        ),
        ({"loss": 3}, r"loss must be a keras.losses.Loss.*received 3"),
        (
            {"optimizer": "nesterov"},
            r"optimizer must be a keras.optimizers.Optimizer, a Keras optimizer "
            r"name.*received 'nesterov'",
        ),
        ({"optimizer": 0.1}, r"optimizer must be .*received 0.1"),
        ({"devices": ["/cpu:0", "/gpu:3"]}, r"received '/gpu:3', available"),
        ({"variable_device": "/cpu:9"}, r"received '/cpu:9', available"),
    ],
)
def test_bad_arguments_name_what_was_received(kwargs, message):
    args = {
        "model": build_mlp,
        "loss": "mse",
        "optimizer": keras.optimizers.SGD(),
        "devices": ["/cpu:0"],
    }
    args.update(kwargs)

    with pytest.raises(ValueError, match=message):
        Towers(**args)


@pytest.mark.parametrize("name, kind", [("sgd", "SGD"), ("adam", "Adam")])
def test_an_optimizer_by_name_is_keras_own_with_its_defaults(name, kind):
    """As Keras' compile(optimizer="adam"): the optimizer with Keras' defaults."""
    engine = Towers(build_mlp, "mse", name, devices=["/cpu:0", "/cpu:1"])
    assert type(engine.optimizer).__name__ == kind
    default = getattr(keras.optimizers, kind)()
    assert float(engine.optimizer.learning_rate) == float(default.learning_rate)
    _ = engine.train_step(*mlp_batch())
    assert int(engine.optimizer.iterations.numpy()) == 1


def test_a_first_batch_smaller_than_the_towers_warns_once_of_idle_towers():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    engine = Towers(model, devices=[f"/cpu:{t}" for t in range(4)])
    x, y = np.ones((6, 3), "f4"), np.ones((6, 1), "f4")
    with pytest.warns(
        UserWarning, match=r"2 of them idle \(shards of \[1, 1, 0, 0\]\)"
    ):
        engine.fit(x, y, batch_size=2, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # said once
        engine.fit(x, y, batch_size=2, verbose=0)
    assert engine.steps_done == 6

"""``steps_per_execution``: k steps in one call, a loop in the graph, with the
batch hooks, History, epochs and resume as Keras' fit has them (issue 39,
item 6)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from tests.training.test_keras_scripts import Hooks
from towers import Towers


def regression():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def pair(per_execution, num_towers=2, **compile_extra):
    keras.utils.set_random_seed(0)
    mine, theirs = regression(), regression()
    theirs.set_weights(mine.get_weights())
    for model in (mine, theirs):
        model.compile(
            optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
            steps_per_execution=per_execution, **compile_extra,
        )  # fmt: skip
    return Towers(mine, devices=devices(num_towers)), theirs


def arrays(count=100, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 4)).astype("float32")
    return x, (x @ rng.standard_normal((4, 2))).astype("float32")


def assert_close(got, want, name=""):
    np.testing.assert_allclose(
        got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
    )


def assert_same_weights(engine, model):
    for var, theirs in zip(engine.model.weights, model.weights):
        assert_close(var.numpy(), theirs.numpy(), var.path)


@pytest.mark.parametrize("per_execution", [1, 3, 32])
def test_hooks_history_and_weights_are_keras_with_steps_per_execution(per_execution):
    engine, model = pair(per_execution)
    x, y = arrays()  # 10 batches an epoch
    seen = []
    for runner in (engine, model):
        hooks = Hooks()
        history = runner.fit(
            x, y, batch_size=10, epochs=2, verbose=0, shuffle=False,
            validation_data=arrays(30, seed=2), callbacks=[hooks],
        )  # fmt: skip
        seen.append((hooks.calls, history))
    (calls, history), (keras_calls, keras_history) = seen
    # The batch hooks every k batches, indexed as Keras indexes them.
    assert calls == keras_calls
    for name in keras_history.history:
        assert_close(history.history[name], keras_history.history[name], name)
    assert_same_weights(engine, model)


def test_k_batches_of_one_shape_run_in_one_call():
    engine, _ = pair(4)
    calls = []
    run = engine._compiled.run
    engine._compiled.run = lambda kind, *a: calls.append(kind) or run(kind, *a)
    x, y = arrays(95)  # 9 batches of 10, then 5
    engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
    # Executions of 4, 4 and 2 batches, the last two of different shapes.
    assert calls == ["train_steps"] * 4
    assert engine.steps_done == 10
    # The loop is traced once per shape of batch, however many it runs.
    assert engine.trace_count == 2


@pytest.mark.parametrize("steps_per_epoch", [6, 8])
def test_an_epoch_runs_whole_executions_as_keras_does(steps_per_epoch):
    engine, model = pair(3)
    x, y = arrays(60)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()
    seen = []
    for runner in (engine, model):
        hooks = Hooks()
        runner.fit(
            dataset, epochs=2, steps_per_epoch=steps_per_epoch, verbose=0,
            callbacks=[hooks],
        )  # fmt: skip
        seen.append(hooks.calls)
    assert seen[0] == seen[1]
    # 8 steps an epoch by 3: Keras runs three executions, 9 steps.
    assert engine.steps_done == 2 * (-(-steps_per_epoch // 3) * 3)
    assert_same_weights(engine, model)


@pytest.mark.parametrize("per_execution", [2, 5])
def test_evaluate_and_predict_hooks_every_k_batches_as_keras(per_execution):
    engine, model = pair(per_execution)
    x, y = arrays(45)
    seen = []
    for runner in (engine, model):
        hooks = Hooks()
        result = runner.evaluate(x, y, batch_size=10, verbose=0, callbacks=[hooks])
        predicted = runner.predict(x, batch_size=10, verbose=0, callbacks=[hooks])
        seen.append((hooks.calls, result, predicted))
    (calls, result, predicted), (keras_calls, keras_result, keras_predicted) = seen
    assert calls == keras_calls
    assert_close(result, keras_result)
    assert_close(predicted, keras_predicted)


class Stop(Exception):
    pass


class KillAfter(keras.callbacks.Callback):
    """Stops the run abruptly after ``executions`` calls, as a kill would."""

    def __init__(self, executions):
        super().__init__()
        self.left = executions

    def on_train_batch_end(self, batch, logs=None):
        self.left -= 1
        if not self.left:
            raise Stop


def test_a_run_killed_mid_epoch_resumes_at_a_step_boundary(tmp_path):
    x, y = arrays(100)
    options = dict(batch_size=10, epochs=2, verbose=0, shuffle=False)
    straight, _ = pair(3)
    straight.fit(x, y, **options)

    killed, _ = pair(3)
    with pytest.raises(Stop):
        killed.fit(
            x, y, checkpoint_dir=str(tmp_path), checkpoint_every=4,
            callbacks=[KillAfter(6)], **options,
        )  # fmt: skip
    # Saved after the executions that crossed steps 4 and 8 and epoch 1's end;
    # the next execution (steps 13-15) ran, then the kill.
    resumed, _ = pair(3)
    resumed.fit(x, y, checkpoint_dir=str(tmp_path), checkpoint_every=4, **options)

    assert resumed.steps_done == straight.steps_done == 20
    for got, want in zip(resumed.model.get_weights(), straight.model.get_weights()):
        assert_close(got, want)


def test_a_step_whose_gradient_is_not_finite_ends_the_loop_before_any_later():
    keras.utils.set_random_seed(0)
    model = regression()
    engine = Towers(
        model, "mse", keras.optimizers.SGD(0.05), devices(2),
        on_nonfinite="raise", steps_per_execution=4,
    )  # fmt: skip
    x, y = arrays(40)
    x[15] = np.nan  # the second batch of the first execution
    with pytest.raises(FloatingPointError, match="not finite"):
        engine.fit(x, y, batch_size=10, verbose=0, shuffle=False)
    # The first step applied; the second skipped; the third and fourth never ran.
    assert int(engine.optimizer.iterations) == 1
    assert engine.steps_done == 2


@pytest.mark.parametrize("given", [0, 2.5, True])
def test_steps_per_execution_that_is_not_a_positive_integer_is_refused(given):
    with pytest.raises(ValueError, match=f"received steps_per_execution={given!r}"):
        Towers(regression, "mse", "sgd", devices(2), steps_per_execution=given)


def test_a_checked_own_step_is_traced_no_more_than_keras_traces_it():
    # The first-step check traces its one-device reference for an execution
    # of several steps; Adam's slots, made at its first apply, must not cost
    # TensorFlow's trace again on top of towers' own trace (one tower: each
    # tower calls the model's train_step in it).
    traces = {"towers": 0, "keras": 0}

    class Counted(keras.Model):
        who = "keras"

        def train_step(self, data):
            traces[self.who] += 1
            return super().train_step(data)

    x, y = arrays(40)
    for who in traces:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = Counted(inputs, keras.layers.Dense(2, activation="relu")(inputs))
        model.who = who
        model.compile(optimizer="adam", loss="mse", steps_per_execution=10)
        runner = Towers(model, devices=devices(1)) if who == "towers" else model
        runner.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert traces["keras"] >= 1
    assert traces["towers"] <= traces["keras"], traces

"""A Keras script moves over unchanged: each input form, argument, return value
and callback of fit, evaluate and predict, against Keras' own call on one device
with the same compiled model, data and arguments (issue 33's cases).

Each case trains a tiny model (5 -> 3, SGD, MSE) on 2 logical CPUs for a few
steps: what is compared is which batches come in which epoch, what is returned
and what callbacks see, and a wrong batch changes every weight.
"""

import inspect
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.training.test_fit_arguments import arrays, assert_close, assert_same_weights
from towers import Towers


def regression():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


def pair(metrics=None):
    """A towers engine on 2 towers and Keras' model with the same weights,
    both compiled with SGD and MSE (and ``metrics``)."""
    keras.utils.set_random_seed(0)
    engine = Towers(
        regression, "mse", keras.optimizers.SGD(0.05), devices(2), metrics=metrics
    )
    model = regression()
    model.set_weights(engine.model.get_weights())
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=metrics)
    return engine, model


def batches(count=7, size=6, seed=1):
    x, y = arrays(count * size, seed)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


class Batches(keras.utils.PyDataset):
    """A PyDataset of ``batches()``; records which indices were read."""

    def __init__(self, count=7, **kwargs):
        super().__init__(**kwargs)
        self.batches, self.read = batches(count), []

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        self.read.append(index)
        return self.batches[index]


class Hooks(keras.callbacks.Callback):
    """Every hook called, with its epoch or batch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        hook = super().__getattribute__(name)
        if name.startswith("on_") and callable(hook):
            calls = super().__getattribute__("calls")
            return lambda *args, **kwargs: calls.append(
                (name, *[a for a in args if isinstance(a, int)])
            )
        return hook


class Outputs(keras.callbacks.Callback):
    """The outputs ``on_predict_batch_end`` is given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_predict_batch_end(self, batch, logs=None):
        self.seen.append(np.asarray(logs["outputs"]))


def test_a_python_generator_with_steps_per_epoch_and_as_validation_data():
    def generator(seed=1):
        while True:
            yield from batches(3, seed=seed)

    engine, model = pair()
    runs = [
        runner.fit(
            generator(), steps_per_epoch=4, epochs=2, verbose=0,
            validation_data=generator(seed=2), validation_steps=2,
        )
        for runner in (engine, model)
    ]  # fmt: skip
    assert engine.steps_done == 8
    for name in ("loss", "val_loss"):
        assert_close(runs[0].history[name], runs[1].history[name])
    assert_same_weights(engine, model)


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_py_dataset_with_workers_and_as_validation_data(processes):
    engine, model = pair()
    kwargs = dict(epochs=2, shuffle=False, verbose=0)
    workers = dict(workers=2, use_multiprocessing=processes)
    data, keras_data = Batches(**workers), Batches(**workers)
    got = engine.fit(data, validation_data=Batches(3), **kwargs)
    want = model.fit(keras_data, validation_data=Batches(3), **kwargs)
    # Each batch once a pass, and the first two once more: Keras reads them to
    # find the batches' shapes (worker processes read the rest in their copies).
    assert sorted(data.read) == sorted(keras_data.read)
    if not processes:
        assert sorted(data.read) == sorted([*range(7)] * 2 + [0, 1])
    assert_close(got.history["val_loss"], want.history["val_loss"])
    assert_same_weights(engine, model)


@pytest.mark.parametrize(
    "form", ["repeated dataset", "arrays", "finite dataset"], ids=str
)
def test_steps_per_epoch_continues_the_pass_across_epochs_as_keras(form):
    """An epoch takes the next ``steps_per_epoch`` batches; a new pass begins
    only when one runs out (ending that epoch early, with Keras' warning)."""
    x, y = arrays(42)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    data = {
        "repeated dataset": dict(x=dataset.repeat(), epochs=3),
        "arrays": dict(x=x, y=y, batch_size=6, shuffle=False, epochs=3),
        "finite dataset": dict(x=dataset, epochs=4),
    }[form]
    engine, model = pair()
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        got = engine.fit(steps_per_epoch=5, verbose=0, **data)
    with warnings.catch_warnings(record=True) as keras_own:
        warnings.simplefilter("always")
        want = model.fit(steps_per_epoch=5, verbose=0, **data)
    assert_close(got.history["loss"], want.history["loss"])
    assert_same_weights(engine, model)
    ran_out = [str(w.message) for w in keras_own if "ran out of data" in str(w.message)]
    assert [str(w.message) for w in ours if "ran out" in str(w.message)] == ran_out
    assert got.params == want.params


@pytest.mark.parametrize("metrics", [None, ["mae"]], ids=["loss alone", "metrics"])
def test_evaluate_returns_what_keras_returns_with_steps_and_return_dict(metrics):
    engine, model = pair(metrics)
    x, y = arrays()
    for kwargs in [{}, {"steps": 2, "batch_size": 8}, {"return_dict": True}]:
        got = engine.evaluate(x, y, verbose=0, **kwargs)
        want = model.evaluate(x, y, verbose=0, **kwargs)
        assert type(got) is type(want)
        if isinstance(want, dict):
            assert list(got) == list(want)
            got, want = list(got.values()), list(want.values())
        assert_close(got, want)


def test_predict_with_steps_and_callbacks():
    engine, model = pair()
    x, _ = arrays()
    seen = {}
    for name, runner in (("towers", engine), ("keras", model)):
        hooks, outputs = Hooks(), Outputs()
        got = runner.predict(x, batch_size=8, steps=3, callbacks=[hooks, outputs])
        seen[name] = got, hooks.calls, outputs.seen
    (got, calls, outputs), (want, keras_calls, keras_outputs) = seen.values()
    assert got.shape == want.shape == (24, 3)
    assert_close(got, want)
    assert calls == keras_calls
    assert_close(np.concatenate(outputs), np.concatenate(keras_outputs))


def test_callbacks_see_the_hooks_and_params_keras_fit_and_evaluate_call():
    x, y = arrays()
    runs = []
    for runner in pair():
        hooks, evaluated = Hooks(), Hooks()
        history = runner.fit(
            x, y, batch_size=16, epochs=2, validation_data=arrays(12, seed=2),
            validation_freq=2, shuffle=False, verbose=0, callbacks=[hooks],
        )  # fmt: skip
        runner.evaluate(x, y, batch_size=32, verbose=0, callbacks=[evaluated])
        runs.append((hooks.calls, history.params, history.history, evaluated.calls))
    (calls, params, history, evaluated), keras_run = runs
    assert calls == keras_run[0]
    assert params == keras_run[1]
    assert list(history) == list(keras_run[2])
    assert evaluated == keras_run[3]


@pytest.mark.parametrize("save_freq", ["epoch", 2])
def test_backup_and_restore_resumes_at_the_epoch_it_saved(tmp_path, save_freq):
    x, y = arrays()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    runs = []
    for name, runner in zip(["towers", "keras"], pair()):
        backup = str(tmp_path / name)
        kwargs = dict(x=x, y=y, batch_size=16, epochs=4, shuffle=False, verbose=0)
        with pytest.raises(RuntimeError, match="interrupted"):
            callbacks = [
                keras.callbacks.BackupAndRestore(backup, save_freq=save_freq),
                Interrupt(),
            ]
            runner.fit(callbacks=callbacks, **kwargs)
        model = runner.model if isinstance(runner, Towers) else runner
        model.set_weights([w * 0 for w in model.get_weights()])  # lost, restored
        history = runner.fit(
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)],
            **kwargs,
        )
        runs.append(history)
    got, want = runs
    # Saved at epoch 1's end, or (every 2 batches) last inside epoch 1, which
    # Keras' fit then trains again.
    assert got.epoch == want.epoch == ([2, 3] if save_freq == "epoch" else [1, 2, 3])
    assert_close(got.history["loss"], want.history["loss"])


def test_backup_and_restore_with_checkpoint_dir_is_refused_by_name(tmp_path):
    engine, _ = pair()
    x, y = arrays()
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ValueError, match="both keras.callbacks.BackupAndRestore"):
        engine.fit(x, y, callbacks=[backup], checkpoint_dir=str(tmp_path / "ckpt"))
    assert engine.steps_done == 0


def test_a_py_dataset_resumes_at_its_batch_index_none_read_twice(tmp_path):
    """A run stopped mid-epoch (after its checkpoint) and resumed reads each
    batch of the epoch once, and ends where an uninterrupted run does."""

    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 4:
                raise KeyboardInterrupt  # as a kill, after step 4's checkpoint

    kwargs = dict(epochs=2, shuffle=False, verbose=0)
    engine, model = pair()
    start = engine.model.get_weights()
    data = Batches()
    with pytest.raises(KeyboardInterrupt):
        engine.fit(data, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                   callbacks=[Stop()], **kwargs)  # fmt: skip
    data.read.clear()  # (the first run may have read ahead of its step)
    engine, _ = pair()
    engine.model.set_weights(start)
    engine.fit(data, checkpoint_dir=str(tmp_path), **kwargs)
    # Keras' adapter reads batches 0 and 1 for their shapes; then the pass
    # resumes at batch 4, and epoch 2 is whole.
    assert data.read == [0, 1, 4, 5, 6, *range(7)]
    model.fit(Batches(), **kwargs)
    assert_same_weights(engine, model)


REFUSED = {
    # Keras' evaluate passes its own private `_use_cached_eval_dataset` (fit's
    # validation) through **kwargs; towers' fit validates without it.
    ("evaluate", "kwargs"),
}


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_every_keras_parameter_is_taken_in_keras_order_with_keras_defaults(method):
    keras_params = [
        p
        for p in inspect.signature(getattr(keras.Model, method)).parameters.values()
        if p.name != "self" and (method, p.name) not in REFUSED
    ]
    ours = list(inspect.signature(getattr(Towers, method)).parameters.values())[1:]
    assert [p.name for p in ours[: len(keras_params)]] == [p.name for p in keras_params]
    for got, want in zip(ours, keras_params):
        assert (got.name, got.default, got.kind) == (want.name, want.default, want.kind)


@pytest.mark.parametrize("targets", ["sparse", "one_hot"])
@pytest.mark.parametrize("placement", ["central", "replicated"])
def test_a_builder_compiled_with_ce_brings_its_optimizer_loss_and_metrics(
    targets, placement
):
    """A builder that returns a compiled model: its optimizer, its loss (the
    name "ce", resolved by the targets' shapes) and metrics, as Keras' own."""

    def builder():
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(3, activation="softmax")]
        )
        model.compile(keras.optimizers.SGD(0.1), loss="ce", metrics=["accuracy"])
        return model

    keras.utils.set_random_seed(0)
    engine = Towers(builder, devices=devices(2), placement=placement)
    model = builder()
    model.set_weights(engine.model.get_weights())
    x, y = arrays()
    labels = np.argmax(y, axis=1)
    y = labels if targets == "sparse" else np.eye(3, dtype="float32")[labels]
    kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    got, want = engine.fit(x, y, **kwargs), model.fit(x, y, **kwargs)
    assert type(engine.optimizer).__name__ == "SGD"
    assert list(got.history) == list(want.history) == ["accuracy", "loss"]
    assert_close(got.history["loss"], want.history["loss"])
    assert_same_weights(engine, model)


def test_pandas_data_frames_in_fit_evaluate_and_predict():
    import pandas as pd

    x, y = arrays()
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(5)])
    targets = pd.DataFrame(y)
    engine, model = pair()
    kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = engine.fit(frame, targets, validation_data=(frame, targets), **kwargs)
    want = model.fit(frame, targets, validation_data=(frame, targets), **kwargs)
    assert_close(got.history["val_loss"], want.history["val_loss"])
    assert_same_weights(engine, model)
    assert_close(
        engine.evaluate(frame, targets, verbose=0),
        model.evaluate(frame, targets, verbose=0),
    )
    assert_close(engine.predict(frame, verbose=0), model.predict(frame, verbose=0))


def test_model_checkpoint_best_only_then_load_model_predicts_the_same(tmp_path):
    engine, _ = pair()
    x, y = arrays()
    path = str(tmp_path / "best.keras")
    best = keras.callbacks.ModelCheckpoint(path, save_best_only=True, monitor="loss")
    history = engine.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[best])
    assert history.history["loss"][1] < history.history["loss"][0]  # saved last
    loaded = keras.models.load_model(path)
    assert_close(loaded.predict(x, verbose=0), engine.predict(x, verbose=0))


def test_a_generator_with_checkpoints_is_warned_of_and_resumed_by_replay(tmp_path):
    def generator():
        yield from batches(4)

    kwargs = dict(steps_per_epoch=4, verbose=0, checkpoint_dir=str(tmp_path))
    engine, model = pair()
    with pytest.warns(UserWarning, match="a Python generator's position cannot"):
        engine.fit(generator(), epochs=1, **kwargs)
    engine, _ = pair()
    with pytest.warns(UserWarning, match="reads the batches already trained again"):
        engine.fit(generator(), epochs=2, **kwargs)  # epoch 2 only
    # As one uninterrupted fit: epoch 2 finds the generator run out (warned).
    model.fit(generator(), steps_per_epoch=4, epochs=2, verbose=0)
    assert engine.steps_done == 4
    assert_same_weights(engine, model)

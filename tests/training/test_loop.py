"""fit / evaluate: data, metrics, history, callbacks, checkpoints, bad input."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import build_mlp, regression_batch
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_with_checkpoints.py"


def classifier():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def classification_data(examples=50, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y


def make_engine(num_towers=3, build=classifier, metrics=None, seed=0):
    keras.utils.set_random_seed(seed)
    return Towers(
        build,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(0.01),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        metrics=metrics,
    )


def test_fit_equals_train_step_over_the_same_batches_including_the_last_partial():
    x, y = classification_data(50)  # batches of 16: 16, 16, 16, 2
    fitted, stepped = make_engine(), make_engine()

    history = fitted.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    for _ in range(2):
        for start in range(0, 50, 16):
            stepped.train_step(x[start : start + 16], y[start : start + 16])

    for a, b in zip(fitted.model.get_weights(), stepped.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)
    assert int(fitted.optimizer.iterations.numpy()) == 8
    assert fitted.trace_count == 2  # the full batches, and the last partial one
    assert len(history["loss"]) == 2


def test_metrics_and_loss_over_all_towers_equal_the_whole_data():
    x, y = classification_data(37)
    engine = make_engine(4, metrics=["sparse_categorical_accuracy"])
    engine.fit(x, y, batch_size=10, epochs=2, verbose=0)

    results = engine.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)

    logits = engine.model.predict(x, verbose=0)
    expected_accuracy = np.mean(np.argmax(logits, axis=-1) == y)
    expected_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, logits
    )
    np.testing.assert_allclose(
        results["sparse_categorical_accuracy"], expected_accuracy
    )
    np.testing.assert_allclose(results["loss"], float(expected_loss), rtol=1e-5)


def test_history_has_validation_results_and_callbacks_see_every_epoch():
    x, y = classification_data(40)
    seen = []
    callback = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append((epoch, sorted(logs)))
    )
    engine = make_engine(2, metrics=[keras.metrics.SparseCategoricalAccuracy()])

    history = engine.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        verbose=0,
        validation_data=(x, y),
        callbacks=[callback],
    )

    keys = [
        "loss",
        "sparse_categorical_accuracy",
        "val_loss",
        "val_sparse_categorical_accuracy",
    ]
    assert sorted(history) == keys
    assert [len(v) for v in history.values()] == [3, 3, 3, 3]
    assert seen == [(epoch, keys) for epoch in range(3)]
    assert history["loss"][-1] < history["loss"][0]


def test_callback_can_stop_training():
    x, y = classification_data(16)

    class StopAfterOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    history = make_engine(2).fit(
        x, y, batch_size=8, epochs=5, verbose=0, callbacks=[StopAfterOne()]
    )

    assert len(history["loss"]) == 1


def test_steps_per_epoch_on_a_repeated_dataset():
    x, y = classification_data(32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    engine = make_engine(2)

    engine.fit(dataset, epochs=3, steps_per_epoch=2, verbose=0)

    assert int(engine.optimizer.iterations.numpy()) == 6


def test_progress_is_keras_bar_in_place_on_a_terminal_one_line_an_epoch_in_a_file(
    capsys, monkeypatch
):
    x, y = classification_data(16)
    engine = make_engine(2)

    engine.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""
    engine.fit(x, y, batch_size=4, epochs=2, verbose=1)  # stdout is not a tty
    out = capsys.readouterr().out
    assert "\r" not in out and "\b" not in out
    lines = out.splitlines()
    assert [line.split(" - ")[0] for line in lines] == [
        "Epoch 1/2",
        "4/4",
        "Epoch 2/2",
        "4/4",
    ]
    assert all(re.search(r"loss: \d\.\d{4}$", line) for line in lines[1::2])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    engine.fit(x, y, batch_size=4, epochs=1, verbose=1)
    assert "\r" in capsys.readouterr().out  # Keras' bar, updated in place


def test_checkpoints_resume_where_the_last_fit_stopped(tmp_path):
    x, y = classification_data(24)
    straight = make_engine(2)
    straight.fit(x, y, batch_size=8, epochs=4, verbose=0)

    first = make_engine(2)
    first.fit(x, y, batch_size=8, epochs=2, verbose=0, checkpoint_dir=str(tmp_path))
    resumed = make_engine(2, seed=1)  # other initial weights: all come from disk
    history = resumed.fit(
        x, y, batch_size=8, epochs=4, verbose=0, checkpoint_dir=str(tmp_path)
    )

    assert len(history["loss"]) == 2  # epochs 3 and 4 only
    assert int(resumed.optimizer.iterations.numpy()) == 12
    for a, b in zip(resumed.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_checkpoint_of_a_different_model_is_refused_and_left_intact(tmp_path):
    x, y = classification_data(16)
    make_engine(2).fit(
        x, y, batch_size=8, epochs=1, verbose=0, checkpoint_dir=str(tmp_path)
    )
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    wider = make_engine(
        2,
        build=lambda: keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3),
            ]
        ),
    )
    before = [w.copy() for w in wider.model.get_weights()]

    with pytest.raises(
        ValueError, match=r"written by a different model.*saved \[6, 8\]"
    ):
        wider.fit(x, y, batch_size=8, epochs=2, verbose=0, checkpoint_dir=str(tmp_path))

    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    for a, b in zip(wider.model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def run_script(directory, out, slow=False):
    command = [sys.executable, str(SCRIPT), str(directory), str(out)]
    return subprocess.Popen(
        command + (["--slow"] if slow else []),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


def test_sigkill_mid_epoch_then_resume_equals_an_uninterrupted_run(tmp_path):
    straight = run_script(tmp_path / "straight", tmp_path / "straight.npz")
    victim = run_script(tmp_path / "killed", tmp_path / "killed.npz", slow=True)
    for line in victim.stdout:  # strike in the middle of the second epoch
        if line.strip() == "trained epoch 1 step 4":
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(timeout=120)
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed.npz").exists()

    rerun = run_script(tmp_path / "killed", tmp_path / "killed.npz")
    resumed_steps = [line.split()[2:] for line in rerun.stdout]
    assert rerun.wait(timeout=120) == 0 and straight.wait(timeout=120) == 0

    # It picked up after the last saved step: step 4 or 5 of epoch 1 (0-based),
    # never from the start and never skipping one.
    first_epoch, first_step = resumed_steps[0][0], int(resumed_steps[0][2])
    assert first_epoch == "1" and first_step in (4, 5, 6)
    assert [int(s[2]) for s in resumed_steps] == list(range(first_step, 11))
    killed, uninterrupted = (
        np.load(tmp_path / "killed.npz"),
        np.load(tmp_path / "straight.npz"),
    )
    assert int(killed["iterations"]) == int(uninterrupted["iterations"]) == 20
    for key in uninterrupted.files:
        np.testing.assert_allclose(
            killed[key],
            uninterrupted[key],
            rtol=EQUIVALENCE_RTOL,
            atol=EQUIVALENCE_ATOL,
        )


@pytest.mark.parametrize(
    "data, kwargs, message",
    [
        (
            tf.data.Dataset.from_tensor_slices((np.zeros((0, 6)), np.zeros(0))).batch(
                4
            ),
            {},
            r"x holds no examples: received a dataset of 0 batches",
        ),
        (
            tf.data.Dataset.from_tensor_slices(np.zeros((8, 6))).batch(4),
            {},
            r"loss sparse_categorical_crossentropy compares predictions with "
            r"targets; received a batch without targets \(y=None\)",
        ),
        (
            (np.zeros((8, 6)), np.zeros(8)),
            {"batch_size": 0},
            r"batch_size must be a positive integer; received batch_size=0",
        ),
        ("digits", {}, r"Unrecognized data type: x=digits \(of type <class 'str'>\)"),
    ],
    ids=["empty", "not-pairs", "arrays-with-batch-size-0", "string"],
)
def test_bad_data_is_refused_before_training(data, kwargs, message):
    engine = make_engine(2)

    with pytest.raises(ValueError, match=message):
        engine.fit(data, verbose=0, **kwargs)
    assert int(engine.optimizer.iterations.numpy()) == 0


def test_inputs_that_do_not_fit_the_model_name_the_shapes():
    engine = make_engine(2)

    # The batches' shape, as Keras' fit quotes it (batch size None: its spec).
    with pytest.raises(ValueError, match=r"expected axis -1 .* value 6.*\(None, 4\)"):
        engine.fit(
            np.zeros((8, 4), "float32"), np.zeros(8, "int32"), batch_size=8, verbose=0
        )


def test_regression_fit_without_metrics():
    x, y = regression_batch(np.random.default_rng(0), 20)
    engine = Towers(
        build_mlp, "mse", keras.optimizers.SGD, devices=["/cpu:0", "/cpu:1"]
    )

    history = engine.fit(x, y, batch_size=6, epochs=2, verbose=0)

    assert list(history) == ["loss"] and len(history["loss"]) == 2

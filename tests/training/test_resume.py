"""Resuming where the data stood: the input pipeline's position in the checkpoint.

Real processes (tests/scripts/train_with_checkpoints.py --shuffled): a tf.data
pipeline reshuffled every epoch, killed mid-epoch or stopped at an epoch's end,
and relaunched. Each step prints the ids of its batch's examples, so the tests
see what every process read.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.shuffled_run import (
    EPOCHS,
    EXAMPLES,
    SCRIPT,
    STEPS,
    assert_same_weights,
    finish,
    launch,
    steps_of,
)
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.training.preemption import PREEMPTED_EXIT_CODE


def test_a_run_killed_mid_epoch_reads_the_rest_of_its_shuffled_epoch(
    tmp_path, uninterrupted
):
    straight, weights = uninterrupted
    victim = launch(tmp_path / "ckpt", tmp_path / "w.npz", "--epochs", "3", "--slow")
    lines = []
    for line in victim.stdout:  # strike in the middle of the second epoch
        lines.append(line)
        if line.strip() == "trained epoch 1 step 4":
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(timeout=120)
    assert victim.returncode == -signal.SIGKILL
    before = steps_of(lines)
    after = finish(launch(tmp_path / "ckpt", tmp_path / "w.npz", "--epochs", "3"))

    # It resumed after the last saved step: never from the epoch's start, never
    # skipping a step.
    first = min(after)
    assert first[0] == 1 and 2 <= first[1] <= 5
    assert sorted(after) == [
        (e, s) for e in (1, 2) for s in range(1, STEPS + 1) if (e, s) >= first
    ]
    # Every step read what the uninterrupted run read at that step...
    for step, ids in {**before, **after}.items():
        assert ids == straight[step], step
    # ...so the interrupted epoch saw each example exactly once.
    kept = [before[(1, s)] for s in range(1, first[1])]
    rest = [after[(1, s)] for s in range(first[1], STEPS + 1)]
    assert sorted(sum(kept + rest, [])) == list(range(EXAMPLES))
    assert_same_weights(tmp_path / "w.npz", weights)


def test_a_run_resumed_at_an_epochs_end_reshuffles_as_if_never_stopped(
    tmp_path, uninterrupted
):
    straight, weights = uninterrupted
    first = finish(launch(tmp_path / "ckpt", tmp_path / "w1.npz", "--epochs", "1"))
    assert sorted(first) == [(0, s) for s in range(1, STEPS + 1)]
    rest = finish(launch(tmp_path / "ckpt", tmp_path / "w.npz", "--epochs", "3"))
    assert sorted(rest) == [(e, s) for e in (1, 2) for s in range(1, STEPS + 1)]
    for step, ids in {**first, **rest}.items():
        assert ids == straight[step], step
    assert_same_weights(tmp_path / "w.npz", weights)


def test_shuffled_arrays_killed_mid_epoch_resume_in_the_uninterrupted_order(
    tmp_path, uninterrupted_arrays
):
    # fit shuffles arrays every epoch. The resumed run draws another seed
    # (--seed 1): the checkpoint's must win, for this epoch and the next.
    straight, weights = uninterrupted_arrays
    orders = [[straight[(e, s)] for s in range(1, STEPS + 1)] for e in range(3)]
    assert orders[0] != orders[1]  # reshuffled every epoch...
    assert sorted(sum(orders[0], [])) == list(range(EXAMPLES))  # ...each example once
    victim = launch(
        tmp_path / "ckpt",
        tmp_path / "w.npz",
        "--epochs",
        "3",
        "--slow",
        data="--arrays",
    )
    lines = []
    for line in victim.stdout:
        lines.append(line)
        if line.strip() == "trained epoch 1 step 4":
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(timeout=120)
    before = steps_of(lines)
    resumed = launch(
        tmp_path / "ckpt", tmp_path / "w.npz", "--epochs", "3", "--seed", "1",
        data="--arrays",
    )  # fmt: skip
    after = finish(resumed)

    assert min(after) in [(1, 4), (1, 5)]  # after the last saved step
    for step, ids in {**before, **after}.items():
        assert ids == straight[step], step
    assert_same_weights(tmp_path / "w.npz", weights)


def test_a_pipeline_whose_position_cannot_be_saved_is_resumed_by_skipping(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 4)).astype("float32")
    y = rng.standard_normal((24, 1)).astype("float32")

    def pipeline():
        def rows():
            yield from zip(x, y)

        spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))
        return tf.data.Dataset.from_generator(rows, output_signature=spec).batch(8)

    def engine():
        keras.utils.set_random_seed(0)
        return Towers(
            lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
            "mse",
            lambda: keras.optimizers.Adam(0.05),
            devices=["/cpu:0", "/cpu:1"],
        )

    straight = engine()
    straight.fit(pipeline(), epochs=2, verbose=0)
    first = engine()
    with pytest.warns(
        UserWarning,
        match=r"cannot save this input's position .*PyFunc is stateful.*"
        r"reads the batches already trained again and drops them",
    ):
        first.fit(pipeline(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    resumed = engine()
    with pytest.warns(UserWarning, match="cannot save this input's position"):
        history = resumed.fit(
            pipeline(), epochs=2, verbose=0, checkpoint_dir=str(tmp_path)
        )
    assert len(history["loss"]) == 1 and int(resumed.optimizer.iterations) == 6
    for a, b in zip(resumed.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


class CrashAt(keras.callbacks.Callback):
    """Raises after batch ``batch`` of epoch ``epoch`` (0-based): that step
    trained, its checkpoint not yet written."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("crash")


def regression(metrics=None, seed=0):
    keras.utils.set_random_seed(seed)
    return Towers(
        lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        "mse",
        lambda: keras.optimizers.Adam(0.05),
        devices=["/cpu:0", "/cpu:1"],
        metrics=metrics,
    )


def regression_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype("float32")
    return x, (x @ [[1.0], [-2.0], [0.5], [3.0]] + 1).astype("float32")


def fit(engine, directory, **kwargs):
    return engine.fit(
        *regression_data(),
        batch_size=8,
        epochs=3,
        verbose=0,
        checkpoint_dir=str(directory),
        checkpoint_every=1,
        **kwargs,
    ).history


class NoisyStep(keras.Sequential):
    """Its own train_step, noising its inputs from a seed generator of its
    own (as the fit guide's GAN noises its labels)."""

    def __init__(self, layers):
        super().__init__(layers)
        self.seeds = keras.random.SeedGenerator(4)

    def train_step(self, data):
        x, y = data
        x = x + 0.1 * keras.random.normal(keras.ops.shape(x), seed=self.seeds)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def drawing(kind):
    """A model whose Dropout draws a mask each step, with Keras' step or
    :class:`NoisyStep`'s."""
    keras.utils.set_random_seed(2)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
              keras.layers.Dropout(0.4, seed=5), keras.layers.Dense(1)]  # fmt: skip
    model = NoisyStep(layers) if kind == "own" else keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return Towers(model, devices=["/cpu:0", "/cpu:1"])


@pytest.mark.parametrize("kind", ["built_in", "own"])
def test_a_resumed_run_draws_on_where_the_uninterrupted_one_would(tmp_path, kind):
    # Killed after step 3's update, before its checkpoint: resumed from step 2,
    # its seed states too, so steps 3 to 15 draw the uninterrupted run's masks.
    straight = drawing(kind)
    fit(straight, tmp_path / "straight")
    killed = drawing(kind)
    with pytest.raises(RuntimeError, match="crash"):
        fit(killed, tmp_path / "resumed", callbacks=[CrashAt(0, 2)])
    resumed = drawing(kind)
    fit(resumed, tmp_path / "resumed")

    assert resumed.steps_done == straight.steps_done == 15
    for got, want in zip(resumed.model.variables, straight.model.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)


def test_a_checkpoint_saved_without_seed_states_still_resumes(tmp_path, monkeypatch):
    # As an older towers wrote them: the run resumes, its draws from the
    # seed states as they are.
    from towers.step.step import Step

    own = Step.state
    with monkeypatch.context() as patched:
        patched.setattr(Step, "state", lambda self: {
            k: v for k, v in own(self).items() if k != "seed_states"})  # fmt: skip
        older = drawing("built_in")
        with pytest.raises(RuntimeError, match="crash"):
            fit(older, tmp_path, callbacks=[CrashAt(0, 2)])
    resumed = drawing("built_in")
    fit(resumed, tmp_path)
    assert resumed.steps_done == 15


@pytest.mark.parametrize("batch", [2, 4], ids=["mid-epoch", "last-step"])
def test_a_resumed_epoch_reports_the_whole_epochs_loss_and_metrics(tmp_path, batch):
    straight = fit(regression(["mae"]), tmp_path / "straight")
    with pytest.raises(RuntimeError, match="crash"):
        fit(regression(["mae"]), tmp_path / "ckpt", callbacks=[CrashAt(1, batch)])
    resumed = fit(regression(["mae"], seed=1), tmp_path / "ckpt")

    # Epochs 2 and 3: the resumed epoch's loss and mae are over all 5 of its
    # steps (4 of them trained before the crash at "last-step"), not its rest.
    assert set(resumed) == {"loss", "mae"}
    for name in resumed:
        np.testing.assert_allclose(resumed[name], straight[name][1:], rtol=1e-5)


def test_a_checkpoint_with_other_metrics_still_resumes_and_numbers_on(tmp_path):
    with pytest.raises(RuntimeError, match="crash"):
        fit(regression(["mae"]), tmp_path, callbacks=[CrashAt(1, 2)])
    saved = kept(tmp_path)
    straight = fit(regression(["mse"]), tmp_path / "straight")
    with pytest.warns(UserWarning, match=r"other loss and metric.*epoch 2 reports"):
        resumed = fit(regression(["mse"], seed=1), tmp_path)

    # The training state came back (the last epoch is the uninterrupted one's);
    # the resumed epoch's mse starts afresh, over its remaining steps only.
    np.testing.assert_allclose(resumed["loss"][1], straight["loss"][2], rtol=1e-5)
    assert not np.isclose(resumed["mse"][0], straight["mse"][1], rtol=1e-3)
    # Numbered on from the checkpoint's save counter: no kept prefix rewritten.
    assert int(kept(tmp_path)[-1].name[5:]) > int(saved[0].name[5:])


def run(directory, out, *flags):
    command = [sys.executable, str(SCRIPT), str(directory), str(out), "--shuffled"]
    return subprocess.run(
        command + list(flags),
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


def kept(directory):
    """The kept checkpoints' prefixes, newest first."""
    numbers = sorted(int(p.name[5:-6]) for p in directory.glob("ckpt-*.index"))
    return [directory / f"ckpt-{n}" for n in reversed(numbers)]


def truncate_data(prefix):
    data = Path(f"{prefix}.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return data


def garble_index(prefix):
    index = Path(f"{prefix}.index")
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 3 : len(raw) // 3 + 64] = bytes(range(64))
    index.write_bytes(bytes(raw))
    return index


@pytest.mark.parametrize("damage", [truncate_data, garble_index])
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(
    tmp_path, uninterrupted, damage
):
    straight, weights = uninterrupted
    ckpt = tmp_path / "ckpt"
    done = run(ckpt, tmp_path / "w1.npz", "--epochs", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    newest, before = kept(ckpt)[:2]
    damage(newest)

    resumed = run(ckpt, tmp_path / "w.npz", "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"the checkpoint {newest} is damaged (" in resumed.stderr
    assert f"resuming from the one before it, {before}" in resumed.stderr
    # ckpt-10 held the end of epoch 0; ckpt-9 its step 9: step 10 is trained
    # again, from the position ckpt-9 saved, and nothing else is.
    steps = steps_of(resumed.stdout.splitlines())
    assert sorted(steps) == [(0, 10)] + [
        (e, s) for e in (1, 2) for s in range(1, STEPS + 1)
    ]
    for step, ids in steps.items():
        assert ids == straight[step], step
    assert_same_weights(tmp_path / "w.npz", weights)


def test_when_no_checkpoint_reads_back_the_run_stops_naming_each(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, tmp_path / "w1.npz", "--epochs", "1").returncode == 0
    damaged = kept(ckpt)
    assert len(damaged) == 3
    for prefix in damaged:
        truncate_data(prefix)

    resumed = run(ckpt, tmp_path / "w.npz", "--epochs", "3")
    assert resumed.returncode != 0
    assert f"ValueError: no checkpoint in {ckpt} can be read" in resumed.stderr
    for prefix in damaged:
        assert f"{prefix}: " in resumed.stderr
    # It did not start over while claiming to resume: no step ran.
    assert "trained" not in resumed.stdout and not (tmp_path / "w.npz").exists()


def damage_state_file(directory, how):
    state = directory / "checkpoint"
    text = state.read_text()
    if how == "missing":
        state.unlink()
    else:
        state.write_text(
            {"garbled": "\x00garbage {{{\n", "cut short": text[: len(text) // 3],
             "empty": ""}[how]
        )  # fmt: skip
    return state


@pytest.mark.parametrize("how", ["garbled", "cut short", "empty", "missing"])
def test_a_damaged_state_file_resumes_from_the_checkpoints_themselves(
    tmp_path, uninterrupted, how
):
    straight, weights = uninterrupted
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, tmp_path / "w1.npz", "--epochs", "1").returncode == 0
    newest = kept(ckpt)[0]
    state = damage_state_file(ckpt, how)

    resumed = run(ckpt, tmp_path / "w.npz", "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = " ".join(resumed.stderr.split())
    assert f"the checkpoint state file {state} is damaged" in said
    assert f"that reads back whole, {newest}." in said
    # Resumed after epoch 0 (ckpt-10), not from step 0: epochs 1 and 2 only,
    # each step reading what the uninterrupted run read.
    steps = steps_of(resumed.stdout.splitlines())
    assert sorted(steps) == [(e, s) for e in (1, 2) for s in range(1, STEPS + 1)]
    for step, ids in steps.items():
        assert ids == straight[step], step
    assert_same_weights(tmp_path / "w.npz", weights)
    # The saves rewrote the state file: it names the newest checkpoint again.
    latest = tf.train.get_checkpoint_state(str(ckpt)).model_checkpoint_path
    assert latest == str(kept(ckpt)[0])


def test_a_damaged_state_file_without_checkpoints_starts_over_and_says_so(
    tmp_path, uninterrupted
):
    straight, weights = uninterrupted
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "ckpt-')

    fresh = run(ckpt, tmp_path / "w.npz", "--epochs", "3")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    said = " ".join(fresh.stderr.split())
    assert f"the checkpoint state file {ckpt / 'checkpoint'} is damaged" in said
    assert "holds no checkpoint (no ckpt-N.index); starting from step 0" in said
    assert sorted(steps_of(fresh.stdout.splitlines())) == sorted(straight)
    assert_same_weights(tmp_path / "w.npz", weights)


@pytest.mark.filterwarnings("ignore:the checkpoint .* holds the input pipeline")
def test_a_worker_that_does_not_save_reads_past_a_damaged_state_file_as_it_is(
    tmp_path,
):
    # A cluster's other workers restore from the chief's directory and never
    # write it: they find the checkpoints by their files and leave the state
    # file to the chief.
    from towers.training.checkpoint import TrainingCheckpoint

    trained = regression()
    fit(trained, tmp_path)
    newest = kept(tmp_path)[0]
    state = damage_state_file(tmp_path, "empty")
    worker = regression(seed=1)
    checkpoint = TrainingCheckpoint(worker, str(tmp_path), writes=False)
    with pytest.warns(UserWarning, match="state file .* is damaged"):
        epoch, step, _ = checkpoint.restore()

    assert (epoch, step) == (3, 0)  # after the third epoch
    for mine, saved in zip(worker.model.get_weights(), trained.model.get_weights()):
        np.testing.assert_array_equal(mine, saved)
    assert state.read_text() == "" and kept(tmp_path)[0] == newest


def test_a_file_where_the_checkpoint_directory_should_be_is_refused_first(tmp_path):
    keras.utils.set_random_seed(0)
    engine = Towers(
        lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        "mse",
        lambda: keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
    )
    before = [w.copy() for w in engine.model.get_weights()]
    taken = tmp_path / "ckpt"
    taken.write_text("not a directory")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=f"received '{taken}', which is a file"):
        engine.fit(x, y, batch_size=4, verbose=0, checkpoint_dir=str(taken))
    with pytest.raises(ValueError, match=rf"'{taken}/inner' cannot be written \("):
        engine.fit(x, y, batch_size=4, verbose=0, checkpoint_dir=str(taken / "inner"))
    assert taken.read_text() == "not a directory" and engine.steps_done == 0
    for a, b in zip(engine.model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_sigterm_finishes_the_step_saves_and_exits_then_resumes(
    tmp_path, uninterrupted
):
    straight, weights = uninterrupted
    ckpt = tmp_path / "ckpt"
    victim = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), str(tmp_path / "w.npz"),
         "--shuffled", "--epochs", "3", "--slow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    lines = []
    for line in victim.stdout:  # the notice comes mid-epoch, during step 4's end
        lines.append(line)
        if line.strip() == "trained epoch 1 step 4":
            victim.send_signal(signal.SIGTERM)
            break
    lines += victim.stdout.read().splitlines()
    victim.wait(timeout=120)
    assert victim.returncode == PREEMPTED_EXIT_CODE == 75
    assert "preempted (SIGTERM): stopped after epoch 2 step 4" in victim.stderr.read()
    before = steps_of(lines)
    assert max(before) == (1, 4) and not (tmp_path / "w.npz").exists()

    after = finish(launch(ckpt, tmp_path / "w.npz", "--epochs", "3"))
    # No step lost or repeated: the relaunch starts with the step after.
    assert min(after) == (1, 5)
    assert sorted({**before, **after}) == sorted(straight)
    assert len(before) + len(after) == EPOCHS * STEPS
    for step, ids in {**before, **after}.items():
        assert ids == straight[step], step
    assert_same_weights(tmp_path / "w.npz", weights)


def unprivileged():
    """A command prefix under which permission bits apply to this user: root's
    capabilities to override them dropped (setpriv); nothing for another user."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


def refused(prefix, ckpt, tmp_path):
    done = subprocess.run(
        [*prefix, sys.executable, str(SCRIPT), str(ckpt), str(tmp_path / "w.npz"),
         "--shuffled", "--epochs", "1"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert done.returncode != 0
    # Refused before the first step: nothing trained, nothing written.
    assert "trained" not in done.stdout and not (tmp_path / "w.npz").exists()
    return done.stderr


def test_a_checkpoint_dir_without_permission_is_refused_first(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    ckpt = locked / "ckpt"
    stderr = refused(unprivileged(), ckpt, tmp_path)
    assert f"checkpoint_dir '{ckpt}' cannot be written (Permission denied)" in stderr


def test_a_checkpoint_dir_on_a_full_disk_is_refused_first(tmp_path):
    # A 16 KB tmpfs, filled, in a mount namespace of this test's own.
    full = tmp_path / "full"
    full.mkdir()
    fill = (
        f"mount -t tmpfs -o size=16k towers-full {full} && "
        f'(head -c 65536 /dev/zero > {full}/filler; true) && exec "$@"'
    )
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    prefix = ["unshare", "--mount", "--propagation", "private", *user,
              "sh", "-c", fill, "sh"]  # fmt: skip
    stderr = refused(prefix, full / "ckpt", tmp_path)
    assert (
        f"checkpoint_dir '{full / 'ckpt'}' cannot be written (No space left on device)"
        in stderr
    ), stderr[-2000:]


def test_a_resumed_fit_says_where_it_goes_on_and_when_nothing_is_left(tmp_path, capsys):
    from towers import Towers

    def engine():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        return Towers(model, devices=["/cpu:0", "/cpu:1"])

    x, y = np.ones((8, 3), "f4"), np.ones((8, 1), "f4")
    fit = dict(batch_size=4, verbose=2, checkpoint_dir=str(tmp_path))
    engine().fit(x, y, epochs=2, **fit)
    assert "Resumed from" not in capsys.readouterr().out  # a fresh start
    history = engine().fit(x, y, epochs=2, **fit)
    said = capsys.readouterr().out
    assert f"Resumed from {tmp_path}" in said, said
    assert "its 2 epochs are the 2 asked for; nothing left to train" in said
    assert history.history == {}
    engine().fit(x, y, epochs=3, **fit)
    assert "training goes on at epoch 3/3." in capsys.readouterr().out

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

from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

SCRIPT = Path(__file__).parent / "scripts" / "train_with_checkpoints.py"
EXAMPLES, EPOCHS, STEPS = 76, 3, 10


def launch(directory, out, *flags):
    command = [sys.executable, str(SCRIPT), str(directory), str(out), "--shuffled"]
    return subprocess.Popen(
        command + list(flags),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


def steps_of(lines):
    """{(epoch, step): ids} from the script's "ids ..." / "trained ..." pairs."""
    steps, ids = {}, None
    for line in lines:
        words = line.split()
        if words and words[0] == "ids":
            ids = [int(i) for i in words[1].split(",")]
        elif words[:1] == ["trained"]:
            steps[(int(words[2]), int(words[4]))] = ids
    return steps


def finish(process):
    lines = list(process.stdout)
    assert process.wait(timeout=180) == 0
    return steps_of(lines)


def assert_same_weights(path, reference):
    mine, theirs = np.load(path), np.load(reference)
    assert int(mine["iterations"]) == int(theirs["iterations"]) == EPOCHS * STEPS
    for key in theirs.files:
        np.testing.assert_allclose(
            mine[key], theirs[key], rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("straight")
    steps = finish(launch(directory / "ckpt", directory / "w.npz", "--epochs", "3"))
    assert len(steps) == EPOCHS * STEPS
    orders = [sum((steps[(e, s)] for s in range(1, STEPS + 1)), []) for e in range(3)]
    for order in orders:  # every epoch reads every example once...
        assert sorted(order) == list(range(EXAMPLES))
    assert orders[0] != orders[1] != orders[2]  # ...in an order of its own
    return steps, directory / "w.npz"


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
        match=r"cannot save this input pipeline's position .*PyFunc is stateful.*"
        r"skips the batches already trained",
    ):
        first.fit(pipeline(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    resumed = engine()
    with pytest.warns(UserWarning, match="cannot save this input pipeline"):
        history = resumed.fit(
            pipeline(), epochs=2, verbose=0, checkpoint_dir=str(tmp_path)
        )
    assert len(history["loss"]) == 1 and int(resumed.optimizer.iterations) == 6
    for a, b in zip(resumed.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)

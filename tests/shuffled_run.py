"""The shuffled training script's runs (tests/scripts/train_with_checkpoints.py
--shuffled): launching it, reading what each step trained on, and the uninterrupted
run every resume is compared with (the ``uninterrupted`` fixture, tests/conftest.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL

SCRIPT = Path(__file__).parent / "scripts" / "train_with_checkpoints.py"
EXAMPLES, EPOCHS, STEPS = 76, 3, 10


def launch(directory, out, *flags, data="--shuffled"):
    """The script on ``data``: "--shuffled" (a tf.data pipeline reshuffled
    every epoch) or "--arrays" (arrays, which fit shuffles every epoch)."""
    command = [sys.executable, str(SCRIPT), str(directory), str(out), data]
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


def uninterrupted_run(tmp_path_factory, data="--shuffled"):
    """3 epochs, never stopped: ({(epoch, step): ids}, its weights' path)."""
    directory = tmp_path_factory.mktemp("straight")
    steps = finish(
        launch(directory / "ckpt", directory / "w.npz", "--epochs", "3", data=data)
    )
    assert len(steps) == EPOCHS * STEPS
    orders = [sum((steps[(e, s)] for s in range(1, STEPS + 1)), []) for e in range(3)]
    for order in orders:  # every epoch reads every example once...
        assert sorted(order) == list(range(EXAMPLES))
    assert orders[0] != orders[1] != orders[2]  # ...in an order of its own
    return steps, directory / "w.npz"

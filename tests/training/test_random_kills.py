"""SIGKILL at ten random moments, inside steps and inside checkpoint saves.

A real process (tests/scripts/train_with_checkpoints.py --shuffled --saves) saves
after every step, on data reshuffled every epoch. It is killed ten times, each at
a random moment drawn within a random step (inside the step, or inside the save
after it), and relaunched each time. The SIGKILL comes from a timer thread in the
victim (``--kill-after``), so it strikes when drawn: this test reading the
output would lag on a busy machine by more than a save lasts. Where it struck is
read from what the victim printed before it died.

The run must end as if never stopped: each relaunch starts with the step after
the newest checkpoint on disk, the steps that were kept read what the
uninterrupted run read, and the final weights and step count equal its.
"""

import random
import signal

import keras
import numpy as np
import tensorflow as tf

from tests.shuffled_run import (
    EPOCHS,
    STEPS,
    assert_same_weights,
    finish,
    launch,
    steps_of,
)
from towers import Towers

KILLS = 10
TOTAL = EPOCHS * STEPS


def newest_steps(directory):
    """How many steps the newest checkpoint that a relaunch will find holds."""
    prefix = tf.train.latest_checkpoint(str(directory))
    if prefix is None:
        return 0
    return int(tf.train.load_variable(prefix, "steps_done/.ATTRIBUTES/VARIABLE_VALUE"))


def numbered(steps):
    """{global step (1-based): ids} from {(epoch, step): ids}."""
    return {epoch * STEPS + step: ids for (epoch, step), ids in steps.items()}


def killed(process):
    """Waits for ``process`` to be killed; returns every line it printed, and
    whether it died inside a checkpoint save or a step."""
    lines = process.stdout.read().splitlines()
    process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL, lines[-5:]
    saves = [line for line in lines if line.split()[:1] in (["saving"], ["saved"])]
    inside_save = bool(saves) and saves[-1].startswith("saving")
    return lines, "save" if inside_save else "step"


def test_ten_kills_at_random_moments_end_as_if_never_stopped(tmp_path, uninterrupted):
    straight, weights = uninterrupted
    straight = numbered(straight)
    seed = random.SystemRandom().randrange(2**32)  # a fresh draw each run
    rng = random.Random(seed)
    # Half strike inside the save after a step, half inside the step after a save.
    places = rng.sample(["save"] * (KILLS // 2) + ["step"] * (KILLS // 2), KILLS)
    ckpt, out = tmp_path / "ckpt", tmp_path / "w.npz"
    flags = ("--epochs", str(EPOCHS), "--saves")
    kept, struck = {}, []
    for place in places:
        resume_at = newest_steps(ckpt) + 1
        # The relaunch's first or second step: ten kills fit in the run's steps.
        target = min(resume_at + rng.randrange(2), TOTAL - 1)
        marker = "saving" if place == "save" else "saved"
        # A save lasts ~20 ms here, a step ~2 ms (the model is one Dense layer).
        delay = rng.uniform(0, 0.015 if place == "save" else 0.001)
        kill = ("--kill-after", str(target), marker, str(delay))
        lines, where = killed(launch(ckpt, out, *flags, *kill))
        context = f"seed {seed}, killed {delay * 1e3:.1f} ms after {marker} {target}"
        trained = numbered(steps_of(lines))
        assert trained and min(trained) == resume_at, context
        # What this run saved before it died is kept; what it trained after
        # that is trained again by the next run.
        saved = newest_steps(ckpt)
        assert resume_at - 1 <= saved <= max(trained), context
        kept.update({s: ids for s, ids in trained.items() if s <= saved})
        struck.append(where)

    resume_at = newest_steps(ckpt) + 1
    last = numbered(finish(launch(ckpt, out, *flags)))
    assert min(last) == resume_at and max(last) == TOTAL, seed
    kept.update(last)
    # No step lost or repeated: each step kept once, reading what it read when
    # never stopped, and the weights and optimizer step count are that run's.
    assert sorted(kept) == list(range(1, TOTAL + 1)), seed
    for step, ids in kept.items():
        assert ids == straight[step], (seed, step)
    assert_same_weights(out, weights)
    # The kills struck inside saves and inside steps both.
    assert "save" in struck and "step" in struck, (seed, struck)


def test_no_save_rewrites_a_kept_checkpoint(tmp_path, monkeypatch):
    # TensorFlow rewrites an existing prefix's .index in place (after moving the
    # new data file over the old): a kill in between would damage a checkpoint
    # that was whole. So every save, the epoch-end ones included, gets a prefix
    # of its own, and the epoch's last step is saved once.
    written = []
    save = tf.train.CheckpointManager.save

    def recording(manager, *args, **kwargs):
        written.append(save(manager, *args, **kwargs))
        return written[-1]

    monkeypatch.setattr(tf.train.CheckpointManager, "save", recording)
    engine = Towers(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
    )
    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    engine.fit(
        x, x[:, :1], batch_size=2, epochs=2, verbose=0,
        checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_checkpoints=50,
    )  # fmt: skip
    assert len(written) == len(set(written)) == 2 * 4  # 4 steps an epoch
    assert engine.steps_done == 8

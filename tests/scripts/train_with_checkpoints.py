"""Trains a small model with checkpoints; the kill-and-resume tests run this.

Usage: train_with_checkpoints.py CHECKPOINT_DIR WEIGHTS_OUT.npz [--slow]
           [--shuffled | --arrays] [--seed N] [--epochs N]
           [--saves [--kill-after N saving|saved SECONDS]]

Prints "trained epoch E step S" after every step (flushed), and saves the final
weights and optimizer iteration count to WEIGHTS_OUT. The data are arrays that
fit shuffles every epoch (its default). With ``--shuffled`` they are a tf.data
pipeline reshuffled every epoch instead; with either flag each step first prints
"ids I,J,..." (the examples of the batch, read from the first feature), and
``--arrays`` is the arrays with ids. ``--seed N``: keras.utils.set_random_seed(N)
(default 0), where fit draws its shuffle seed from. With
``--saves`` every checkpoint save is bracketed by "saving N" and "saved N" (N: the
steps it holds), so a killer knows whether it struck inside a save.
``--kill-after 12 saving 0.003`` SIGKILLs this process 3 ms after "saving 12" was
printed, from a timer thread: the moment is exact, where a parent reading the
output on a busy 2-core machine would lag by more than a save lasts.
"""

import functools
import os
import signal
import sys
import threading
import time

import towers

towers.virtual_devices(3)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import towers.training.checkpoint  # noqa: E402

EPOCHS, BATCH, EXAMPLES = 2, 8, 76  # 10 batches an epoch, the last one of 4


class Announce(keras.callbacks.Callback):
    def __init__(self, slow):
        super().__init__()
        self.slow, self.epoch = slow, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"trained epoch {self.epoch} step {batch + 1}", flush=True)
        if self.slow:
            time.sleep(0.2)  # leaves the killer time to strike mid-epoch


def data(shuffled):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, 5)).astype("float32")
    x[:, 0] = np.arange(EXAMPLES) / EXAMPLES  # the example's id, as a feature
    y = rng.standard_normal((EXAMPLES, 1)).astype("float32")
    if not shuffled:
        return {"x": x, "y": y, "batch_size": BATCH}
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    dataset = dataset.shuffle(EXAMPLES, seed=7, reshuffle_each_iteration=True)
    return {"x": dataset.batch(BATCH)}


def announce_saves(kill_after):
    save = towers.training.checkpoint.TrainingCheckpoint.save

    def say(marker):
        print(marker, flush=True)
        if marker == kill_after[0]:
            kill = functools.partial(os.kill, os.getpid(), signal.SIGKILL)
            threading.Timer(kill_after[1], kill).start()

    def announced(self, epoch, step, position=(0, 0)):
        say(f"saving {self._engine.steps_done}")
        save(self, epoch, step, position)
        say(f"saved {self._engine.steps_done}")

    towers.training.checkpoint.TrainingCheckpoint.save = announced


def main(directory, out, slow, shuffled, epochs, ids=False, seed=0):
    keras.utils.set_random_seed(seed)
    engine = towers.Towers(
        lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)]),
        "mse",
        lambda: keras.optimizers.Adam(0.05),
        devices=towers.virtual_devices(3),
    )
    if ids:
        fit_steps = engine.fit_steps  # what fit trains each execution with

        def announce_ids(batches):
            for x, *_ in batches:
                ids = np.rint(np.asarray(x)[:, 0] * EXAMPLES).astype(int)
                print("ids " + ",".join(map(str, ids)), flush=True)
            return fit_steps(batches)

        engine.fit_steps = announce_ids
    engine.fit(
        **data(shuffled),
        epochs=epochs,
        verbose=0,
        checkpoint_dir=directory,
        checkpoint_every=1,
        callbacks=[Announce(slow)],
    )
    np.savez(
        out,
        *engine.model.get_weights(),
        iterations=int(engine.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    epochs = int(args[args.index("--epochs") + 1]) if "--epochs" in args else EPOCHS
    if "--saves" in args:
        kill_after = (None, 0.0)
        if "--kill-after" in args:
            at = args.index("--kill-after")
            kill_after = (f"{args[at + 2]} {args[at + 1]}", float(args[at + 3]))
        announce_saves(kill_after)
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    shuffled = "--shuffled" in args
    ids = shuffled or "--arrays" in args
    main(args[0], args[1], "--slow" in args, shuffled, epochs, ids, seed)

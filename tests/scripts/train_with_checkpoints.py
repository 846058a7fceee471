"""Trains a small model with checkpoints; the kill-and-resume test runs this.

Usage: train_with_checkpoints.py CHECKPOINT_DIR WEIGHTS_OUT.npz [--slow]
Prints "trained epoch E step S" after every step (flushed), and saves the final
weights and optimizer iteration count to WEIGHTS_OUT.
"""

import sys
import time

import towers

towers.virtual_devices(3)

import keras  # noqa: E402
import numpy as np  # noqa: E402

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


def main(directory, out, slow):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, 5)).astype("float32")
    y = rng.standard_normal((EXAMPLES, 1)).astype("float32")
    engine = towers.Towers(
        lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)]),
        "mse",
        lambda: keras.optimizers.Adam(0.05),
        devices=towers.virtual_devices(3),
    )
    engine.fit(
        (x, y),
        batch_size=BATCH,
        epochs=EPOCHS,
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
    main(sys.argv[1], sys.argv[2], "--slow" in sys.argv)

"""Splitting a batch across devices: ``tf.split`` versus ``towers.split_batch``.

TF1 multi-GPU scripts split each batch with ``tf.split(images, num_gpus)``. That
needs the batch to divide evenly, so the last batch of an epoch (1,797 digits in
batches of 64 leave 5) fails with ``InvalidArgumentError``. The usual ways out
each cost something:

- ``drop_remainder=True`` (or ``batch(..., drop_remainder)``) silently skips
  examples every epoch;
- splitting with explicit sizes, but keeping each tower's *mean* loss and
  averaging the towers, weighs a tower of 1 example like a tower of 2.

``towers.split_batch`` takes any batch size: shards differ by at most one and a
tower may get none (3 examples on 4 towers). ``towers.Towers`` divides each
tower's loss by the global batch, so an uneven split gives exactly the step one
device takes on the whole batch. Run: ``python examples/split_uneven.py``.
``--verbose`` keeps TensorFlow's start-up lines.
"""

import sys

import towers
from towers.commands import start_tensorflow

start_tensorflow(verbose="--verbose" in sys.argv)  # its start-up lines, if asked
DEVICES = towers.virtual_devices(4)  # four "GPUs"; before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((39, 8)).astype("float32")
    y = rng.integers(0, 3, 39).astype("int32")

    try:
        tf.split(x[:7], 4)
        raise AssertionError("tf.split took 7 examples on 4 devices")
    except (tf.errors.InvalidArgumentError, ValueError) as error:
        print(f"tf.split of 7 examples into 4: {type(error).__name__}")
    for batch in (7, 3, 1):
        print(f"towers.split_sizes({batch}, 4) = {towers.split_sizes(batch, 4)}")

    # One epoch in batches of 16: 16, 16, then 7 (split 2, 2, 2, 1).
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = towers.Towers(
        build, loss_fn, lambda: keras.optimizers.Adam(1e-2), devices=DEVICES
    )
    reference, optimizer = build(), keras.optimizers.Adam(1e-2)
    for start in range(0, len(x), 16):
        x_b, y_b = x[start : start + 16], y[start : start + 16]
        engine.train_step(x_b, y_b)
        with tf.GradientTape() as tape:
            loss = loss_fn(y_b, reference(x_b))
        grads = tape.gradient(loss, reference.trainable_variables)
        optimizer.apply_gradients(zip(grads, reference.trainable_variables))
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print(
        "batches of 16, 16, 7 on 4 towers: towers matches one device "
        "(rtol 1e-5), no example dropped"
    )


if __name__ == "__main__":
    main()

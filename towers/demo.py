"""``towers demo``: a short tower training on synthetic data, narrated.

Three Gaussian blobs in 20 dimensions, a small MLP, N towers. At the end the same
batches train one device, and the demo shows both give the same weights.
"""

from __future__ import annotations

import time

import numpy as np


def tower_devices(num_towers: int) -> list[str]:
    """N GPUs when the machine has them, else the CPU split into N logical devices."""
    import tensorflow as tf

    from towers.devices import virtual_devices

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= num_towers:
        return [d.name for d in tf.config.list_logical_devices("GPU")][:num_towers]
    return virtual_devices(num_towers)


# The three blob centres, fixed so training and test data share them.
CENTERS = np.random.default_rng(1234).standard_normal((3, 20)).astype("float32")


def synthetic_batches(steps: int, batch: int, seed: int = 0):
    """(x: f32[batch, 20], y: i32[batch]) from three overlapping blobs."""
    rng = np.random.default_rng(seed)
    centers = CENTERS
    for _ in range(steps):
        y = rng.integers(0, 3, batch).astype("int32")
        x = centers[y] + 1.5 * rng.standard_normal((batch, 20)).astype("float32")
        yield x, y


def build_model():
    import keras

    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def run(num_towers: int = 4, steps: int = 30, batch: int = 50) -> int:
    devices = tower_devices(num_towers)  # before TensorFlow initialises
    import keras
    import tensorflow as tf

    from towers import Towers, split_sizes

    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = Towers(
        build_model, loss, lambda: keras.optimizers.Adam(0.01), devices=devices
    )
    with tf.device(engine.variable_device):
        reference = build_model()
        reference.set_weights(engine.model.get_weights())
    print(f"towers: {num_towers} on {', '.join(devices)}")
    print(f"variables on {engine.variable_device}:")
    for var in engine.model.variables:
        print(f"  {var.path:<28} {str(tuple(var.shape)):<10} {var.handle.device}")
    print(f"each step splits {batch} examples as {split_sizes(batch, num_towers)}")

    batches = list(synthetic_batches(steps, batch))
    started = time.perf_counter()
    for step, (x, y) in enumerate(batches, 1):
        logs = engine.train_step(x, y)
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"  step {step:>3}  loss {float(logs['loss']):.4f}")
    elapsed = time.perf_counter() - started
    print(f"{steps} steps in {elapsed:.2f} s (first step includes tracing)")

    x, y = next(synthetic_batches(1, 1000, seed=1))
    predicted = np.argmax(engine.model.predict(x, verbose=0), axis=-1)
    print(f"accuracy on 1000 new examples: {np.mean(predicted == y):.3f}")

    difference = _train_reference(reference, loss, batches, engine)
    print(
        f"same batches on one device: largest weight difference {difference:.2e} "
        "(float32 rounding; the towers' update is the one-device update)"
    )
    return 0


def _train_reference(reference, loss, batches, engine) -> float:
    """Trains ``reference`` on one device; returns the largest weight difference."""
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(0.01)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, reference(x, training=True))
        grads = tape.gradient(value, reference.trainable_variables)
        optimizer.apply_gradients(zip(grads, reference.trainable_variables))

    with tf.device(engine.variable_device):
        for x, y in batches:
            step(x, y)
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(engine.model.get_weights(), reference.get_weights())
    )

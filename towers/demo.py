"""``towers demo``: a small CNN learns scikit-learn's bundled digits on N towers.

1,797 8x8 handwritten digits ship inside scikit-learn, so nothing is downloaded.
The demo trains with ``Towers.fit``, then shows the test accuracy, where every
variable and each tower's work lived, and what a step costs phase by phase.
"""

from __future__ import annotations

import time

import numpy as np


def tower_devices(num_towers: int) -> list[str]:
    """N GPUs when the machine has them, else the CPU split into N logical devices."""
    import tensorflow as tf

    from towers.devices import virtual_devices

    if len(tf.config.list_physical_devices("GPU")) >= num_towers:
        return [d.name for d in tf.config.list_logical_devices("GPU")][:num_towers]
    return virtual_devices(num_towers)


def load_digits(seed: int = 0):
    """Train and test splits: x f32[n, 8, 8, 1] in [0, 1], y i32[n]."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise RuntimeError(
            "the demo needs scikit-learn for its bundled digits: "
            "pip install 'towers[demo]'"
        ) from error
    digits = sklearn_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(y))
    test = order[:360]
    train = order[360:]
    return (x[train], y[train]), (x[test], y[test])


def build_cnn():
    import keras

    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def run(
    num_towers: int = 4, epochs: int = 12, batch: int = 64, log_dir: str | None = None
) -> int:
    devices = tower_devices(num_towers)  # before TensorFlow initialises
    import keras

    from towers import Towers, split_sizes
    from towers.bench.phases import time_phases

    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits()
    engine = Towers(
        build_cnn,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(2e-3),
        devices=devices,
        metrics=["sparse_categorical_accuracy"],
    )
    print(f"digits: {len(y_train)} train, {len(y_test)} test images of 8x8")
    print(
        f"towers: {num_towers} on {', '.join(devices)}; each batch of {batch} "
        f"splits as {split_sizes(batch, num_towers)}"
    )
    started = time.perf_counter()
    engine.fit(
        (x_train, y_train),
        batch_size=batch,
        epochs=epochs,
        verbose=1,
        log_dir=log_dir,
        profile_steps=(10, 12) if log_dir else None,
    )
    elapsed = time.perf_counter() - started
    results = engine.evaluate((x_test, y_test), batch_size=256)
    print(
        f"\ntest accuracy: {results['sparse_categorical_accuracy']:.4f}  "
        f"(loss {results['loss']:.4f}; {epochs} epochs in {elapsed:.1f} s)"
    )
    _print_placement(engine)
    phases = time_phases(engine, x_train[:batch], y_train[:batch])
    print(f"\none step of {batch} examples, each phase timed on its own:")
    for name in ("compute", "combine", "apply", "step"):
        label = {
            "compute": "towers' forward + backward",
            "combine": "combine",
            "apply": "apply (optimizer)",
            "step": "whole step",
        }[name]
        print(f"  {label:<28} {phases[name]:7.3f} ms")
    return 0


def _print_placement(engine) -> None:
    print(f"\nvariables on {engine.variable_device}:")
    total = sum(var.numpy().nbytes for var in engine.model.variables)
    for var in engine.model.variables:
        print(f"  {var.path:<34} {str(tuple(var.shape)):<16} {var.handle.device}")
    slots = len(engine.optimizer.variables)
    print(
        f"  ({total / 1024:.0f} KiB of weights; {slots} optimizer variables, slots "
        f"on {engine.variable_device})"
    )
    print("each tower's forward and backward ran on its own device:")
    for t, device in enumerate(engine.devices):
        print(f"  tower {t}: {device}")
    print(f"gradients combined and applied on {engine.variable_device}")

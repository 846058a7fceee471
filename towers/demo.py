"""``towers demo``: a small CNN learns scikit-learn's bundled digits on N towers.

1,797 8x8 handwritten digits ship inside scikit-learn, so nothing is downloaded.
The demo trains with ``Towers.fit``, then shows the test accuracy, where every
variable and each tower's work lived (``towers explain``'s report, read from the
graph TensorFlow placed), and what a step costs phase by phase. ``towers explain``
gives the whole report for the same model.
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
            "pip install 'tf-towers[demo]'"
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
        x_train,
        y_train,
        batch_size=batch,
        epochs=epochs,
        verbose=1,
        log_dir=log_dir,
        profile_steps=(10, 12) if log_dir else None,
    )
    elapsed = time.perf_counter() - started
    results = engine.evaluate(
        x_test, y_test, batch_size=256, verbose=0, return_dict=True
    )
    print(
        f"\ntest accuracy: {results['sparse_categorical_accuracy']:.4f}  "
        f"(loss {results['loss']:.4f}; {epochs} epoch{'s' * (epochs != 1)} "
        f"in {elapsed:.1f} s)"
    )
    _print_placement(engine, x_train[:batch], y_train[:batch])
    phases = time_phases(engine, x_train[:batch], y_train[:batch])
    print(f"\none step of {batch} examples, each phase timed alone:")
    labels = {
        "compute": f"the {num_towers} towers' forward and backward passes",
        "combine": "combine: the towers' gradients summed",
        "apply": "apply: the optimizer's update, once",
        "step": "the whole step, as fit runs it",
    }
    for name, label in labels.items():
        print(f"  {label:<52} {phases[name]:7.3f} ms")
    print(
        "  (timed alone, each phase pays its own call; within the step they "
        "overlap:\n  a layer's gradients are summed and applied while the towers "
        "still compute\n  the layers before it. So the phases add up to more "
        "than the step.)"
    )
    return 0


def _print_placement(engine, x, y) -> None:
    """Where the step's variables and ops lived, read from the placed graph."""
    from towers.explain.report import size, summary

    report = engine.explain(x, y)
    held: dict[str, int] = {}
    for var in report.variables:
        held[var.device] = held.get(var.device, 0) + var.bytes
    print(f"\nvariables ({len(report.variables)}: model, optimizer slots, metrics):")
    for device, nbytes in held.items():
        print(f"  {size(nbytes)} on {device}")
    print(summary(report))
    print("(every variable, and a diagram: towers explain --png step.png)")


def explain(
    num_towers: int = 4,
    batch: int = 64,
    placement: str = "central",
    variable_device: str = "/cpu:0",
    png: str | None = None,
    json_path: str | None = None,
    jit_compile: bool = False,
    check: bool = False,
) -> int:
    """``towers explain``: the report of one step of the demo's CNN on digits
    (with ``jit_compile``, each tower's pass as one XLA computation; with
    ``check``, every variable's step against one device's, ``Towers.check``)."""
    devices = tower_devices(num_towers)  # before TensorFlow initialises
    import json

    import keras

    from towers import Towers

    keras.utils.set_random_seed(0)
    (x_train, y_train), _ = load_digits()
    engine = Towers(
        build_cnn,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(2e-3),
        devices=devices,
        variable_device=variable_device,
        placement=placement,
        metrics=["sparse_categorical_accuracy"],
        jit_compile=jit_compile,
    )
    report = engine.explain(x_train[:batch], y_train[:batch])
    print(report)
    if check:
        print("\nthe step against the model's own train_step on one device:")
        print(engine.check(x_train[:batch], y_train[:batch]))
    if png:
        report.save_png(png)
        print(f"\ndiagram: {png}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"data: {json_path}")
    return 0

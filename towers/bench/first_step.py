"""Time to the first step on a real model: what a user waits for before training.

The first step is the trace, TensorFlow's graph optimisation and one step; each
contender's is measured in a fresh process (a second one in the same process
would find Keras' and TensorFlow's caches warm), from the engine's construction
(or ``compile``) to the first loss read back:

- ``keras``: Keras' own ``fit`` on one device, one step (the reference);
- ``tower`` and ``global``: towers with that ``batch_statistics`` (``tower``
  is not one device's, so its first step is not checked against one
  device's: ``towers/training/check.py``);
- ``unchecked``: ``global`` with ``check_first_step=False``: the check's cost
  is ``global``'s time less this;
- ``own`` and ``own_unchecked``: the model inside a model whose own
  ``train_step`` is the fit guide's (tape, ``compute_loss``, one apply),
  checked and not; ``own_tower``: that step with tower statistics, beside
  ``tower``;
- ``tower_call``: towers with tower statistics and
  ``tower_functions="call"`` (each tower's pass a call of its own, not
  inlined into one graph of T copies for TensorFlow to optimise);
- ``xla``: towers with tower statistics and ``jit_compile=True``: TensorFlow
  compiles the tower's pass once per device;
- ``xla_cached``: the same with TensorFlow's persistent XLA cache on (a fresh
  directory per process, so nothing carries over from an earlier run): each
  shard shape compiles once and the other towers load it
  (``towers/step/run/xla.py``);
- ``mirrored``: Keras' ``fit`` under a ``MirroredStrategy`` on the same devices
  (a peer, which also traces the model once per device);
- ``floor``: the first-step floor: one ``tf.function`` holding the model's pass
  (loss and gradients) traced once and called on every device's shard, nothing
  combined and nothing applied. What TensorFlow charges for T copies of one
  pass in one graph (building, optimising and placing them), which any engine
  that runs the towers in one graph pays before the first step.

Run one contender as ``python -m towers.bench.first_step SPEC_JSON`` (prints
one JSON line); :func:`measure` runs several, in turns, round after round.

Example (a fresh process per contender and round, so slow)::

    times = measure("MobileNetV2", towers=4, contenders=["keras", "tower"])
    ratio(times, "tower", "keras")["ratio"]  # tower statistics / Keras' fit
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from towers.bench.timing import ratio, round_order

CONTENDERS = (
    "keras", "tower", "tower_call", "global", "unchecked", "own", "own_unchecked",
    "own_tower", "xla", "xla_cached", "mirrored", "floor",
)  # fmt: skip
# keras.applications models at 32x32 (their smallest input), random weights.
MODELS = {"MobileNetV2": {"alpha": 0.35}, "ResNet50": {}}
BATCH = 32
TIMEOUT_SECONDS = 900


def measure(
    model: str, towers: int, contenders: list[str], rounds: int = 3
) -> dict[str, list[float]]:
    """Seconds to the first step, per contender, one fresh process each, the
    contenders' order rotating from round to round (``round_order``)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in round_order(list(contenders), r):
            spec = {"model": model, "towers": towers, "contender": name}
            times[name].append(_run(spec)["seconds"])
    return times


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "towers.bench.first_step", json.dumps(spec)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory() as cache:
        if spec["contender"] == "xla_cached":
            env["TF_XLA_FLAGS"] = f"--tf_xla_persistent_cache_directory={cache}"
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, env=env
        )
    if done.returncode:
        raise RuntimeError(
            f"first step of {spec} failed with status {done.returncode}:\n"
            f"{done.stderr[-2000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_step(model: str, towers: int, contender: str) -> float:
    """Seconds from the engine's construction to its first loss read back, in
    this process (which must be fresh: see the module docstring)."""
    from towers.devices import virtual_devices

    devices = virtual_devices(towers)  # before TensorFlow starts
    import contextlib

    import keras
    import numpy as np
    import tensorflow as tf

    import towers as towers_lib

    strategy = (
        tf.distribute.MirroredStrategy(devices) if contender == "mirrored" else None
    )

    def scope():
        return strategy.scope() if strategy else contextlib.nullcontext()

    with scope():
        net = getattr(keras.applications, model)(
            weights=None, input_shape=(32, 32, 3), classes=10, **MODELS[model]
        )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy()
    started = time.perf_counter()
    if contender == "floor":
        float(_floor_pass(net, loss, devices)(x, y))
    elif contender in ("keras", "mirrored"):
        with scope():
            net.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        if contender.startswith("own"):  # compiled, as its step reads it
            net = _guides_step(net)
            net.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        engine = towers_lib.Towers(
            net,
            loss,
            keras.optimizers.SGD(0.01),
            devices=devices,
            batch_statistics="tower" if "tower" in contender else "global",
            tower_functions="call" if contender == "tower_call" else "inline",
            jit_compile=contender.startswith("xla"),
            check_first_step=not contender.endswith("unchecked"),
        )
        float(engine.train_step(x, y)["loss"])
    return time.perf_counter() - started


def _guides_step(net: Any) -> Any:
    """``net`` inside a model whose ``train_step`` is the fit guide's."""
    import keras
    import tensorflow as tf

    class GuidesStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return self.compute_metrics(x, y, y_pred)

    inputs = keras.Input(net.input_shape[1:])
    return GuidesStep(inputs, net(inputs))


def _floor_pass(net: Any, loss: Any, devices: list[str]) -> Any:
    """The first-step floor's function (see the module docstring): its loss
    read back is the sum of the towers' losses."""
    import tensorflow as tf

    @tf.function
    def one_pass(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, net(x, training=True))
        return value, tape.gradient(value, net.trainable_weights)

    @tf.function
    def passes(x, y):
        total, gradients = 0.0, []
        for device, xs, ys in zip(
            devices, tf.split(x, len(devices)), tf.split(y, len(devices))
        ):
            with tf.device(device):
                value, grads = one_pass(xs, ys)
            total, gradients = total + value, gradients + grads
        return total + 0.0 * tf.add_n([tf.reduce_sum(g) for g in gradients])

    return passes


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec["contender"] not in CONTENDERS or spec["model"] not in MODELS:
        raise SystemExit(
            f"contender must be one of {list(CONTENDERS)} and model one of "
            f"{list(MODELS)}; received {spec}"
        )
    seconds = first_step(spec["model"], spec["towers"], spec["contender"])
    print(json.dumps({**spec, "seconds": seconds}))
    return 0


__all__ = ["CONTENDERS", "MODELS", "first_step", "measure", "ratio"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

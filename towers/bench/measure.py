"""One ``towers bench`` configuration, measured in its own process.

Run as ``python -m towers.bench.measure SPEC_JSON``; prints one JSON line. The
process splits its devices first (logical devices can only be made before
TensorFlow starts), then times the contender's step and the plain single-device
step on the same global batch in alternating rounds, so their ratio cancels the
noise both see. A towers contender also gets its three phases timed, each as its
own compiled function, and the bytes its towers hand to the combine.

Contenders (``spec["contender"]``):

- ``"towers"``: ``Towers`` with ``spec["placement"]`` and ``spec["reducer"]``;
- ``"single"``: the plain single-device step itself (an A/A run: its ratio is
  this machine's noise floor);
- ``"mirrored"``: ``tf.distribute.MirroredStrategy`` over the same devices;
- ``"central_storage"``: ``tf.distribute.experimental.CentralStorageStrategy``,
  variables on the CPU, compute on the same devices.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

CONTENDERS = ("towers", "single", "mirrored", "central_storage")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from towers.devices import virtual_devices

    if spec.get("virtual"):
        virtual_devices(spec["virtual"], kind=spec.get("kind", "CPU"))
    print(json.dumps(measure(spec)), flush=True)
    return 0


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Times one configuration; returns its record (see ``towers/bench/run.py``)."""
    import keras
    import tensorflow as tf

    from towers.bench.presets import get_preset
    from towers.bench.timing import interleaved_ratio

    keras.utils.set_random_seed(0)
    preset = get_preset(spec["preset"])
    devices = spec["devices"]
    global_batch = spec["batch"] * len(devices)
    x, y = (tf.constant(a) for a in preset.batch(global_batch, seed=0))
    single = _single_step(preset, devices[0], x, y)
    contender, extra = _contender(spec, preset, devices, x, y)
    rounds = max(2, spec["steps"] // 10)
    timed = interleaved_ratio(
        contender, single, rounds=rounds, steps=max(1, spec["steps"] // rounds)
    )
    step_s = timed["contender_ms"] / 1e3
    record = {
        "step_ms": timed["contender_ms"],
        "single_device_ms": timed["baseline_ms"],
        "vs_single_device": timed["ratio"],
        "vs_single_device_q25": timed["ratio_q25"],
        "vs_single_device_q75": timed["ratio_q75"],
        "global_batch": global_batch,
        "examples_per_second": global_batch / step_s,
    }
    if "engine" in extra:
        record.update(_phases_and_bytes(extra.pop("engine"), x, y, spec))
    record.update(extra)
    return record


def single_device_step(build, loss_fn, device: str):
    """The textbook step: one device, whole batch, one tf.function ``step(x, y)``.

    Every ratio ``towers bench`` and ``benchmarks/`` report is against this.
    """
    import keras
    import tensorflow as tf

    with tf.device(device):
        model = build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.device(device):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    return step


def _single_step(preset, device: str, x, y):
    step = single_device_step(preset.build, preset.loss(), device)
    return lambda: step(x, y)


def _contender(spec, preset, devices, x, y):
    import keras

    kind = spec["contender"]
    if kind == "single":
        return _single_step(preset, devices[0], x, y), {}
    if kind in ("mirrored", "central_storage"):
        return strategy_step(kind, preset, devices, x, y), {}
    from towers.engine import Towers

    engine = Towers(
        preset.build,
        preset.loss(),
        lambda: keras.optimizers.SGD(0.01),
        devices=devices,
        placement=spec["placement"],
        reducer=spec["reducer"],
        variable_device=spec.get("variable_device", "/cpu:0"),
    )
    return (lambda: engine.train_step(x, y)), {"engine": engine}


def strategy_step(kind: str, preset, devices, x, y):
    """The same model and batch under a tf.distribute strategy's custom loop.

    The batch is split into per-replica shards once, before timing (the towers
    step splits inside its step, so this favours the strategy slightly).
    """
    import keras
    import tensorflow as tf

    if kind == "mirrored":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=devices, parameter_device="/cpu:0"
        )
    with strategy.scope():
        model = preset.build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    per_example = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none"
    )
    global_batch = int(x.shape[0])
    num = len(devices)

    def shard(value):
        def piece(context):
            size = global_batch // num
            start = context.replica_id_in_sync_group * size
            stop = (
                global_batch
                if context.replica_id_in_sync_group == num - 1
                else start + size
            )
            return value[start:stop]

        return strategy.experimental_distribute_values_from_function(piece)

    xs, ys = shard(x), shard(y)

    def replica_step(x_r, y_r):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example(y_r, model(x_r, training=True)),
                global_batch_size=global_batch,
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        losses = strategy.run(replica_step, args=(xs, ys))
        return strategy.reduce("SUM", losses, axis=None)

    return step


def _phases_and_bytes(engine, x, y, spec) -> dict[str, Any]:
    """Phase times, gradient bytes, bandwidths, and where the variables lived."""
    from towers.bench.phases import gradient_bytes, time_phases
    from towers.placement import bytes_by_device

    phases = time_phases(engine, x, y, repeats=max(5, spec["steps"] // 2))
    sent = gradient_bytes(engine, x, y)
    num = engine.num_towers
    combine_s = phases["combine"] / 1e3
    algbw = sent / combine_s if combine_s > 0 else 0.0
    return {
        "phases_ms": {k: phases[k] for k in ("compute", "combine", "apply")},
        "bytes_per_tower": sent,
        "algbw_gbps": algbw / 1e9,
        "busbw_gbps": algbw * 2 * (num - 1) / num / 1e9,
        # busbw assumes a ring; this says what actually ran.
        "topology": engine.placement.topology(),
        "variables_by_device": bytes_by_device(
            [v for model in engine.placement.models for v in model.variables]
        ),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

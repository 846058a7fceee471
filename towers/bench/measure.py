"""One ``towers bench`` configuration, measured in its own process.

Run as ``python -m towers.bench.measure SPEC_JSON``; prints one JSON line. The
process splits its devices first (logical devices can only be made before
TensorFlow starts), then times the contender's step and the plain single-device
step on the same global batch in alternating rounds, so their ratio cancels the
noise both see; with more than one tower, the zero-sync floor too
(``towers/bench/peers.py``). A towers contender also gets its three phases timed,
each as its own compiled function, and the bytes its towers hand to the combine.

Contenders (``spec["contender"]``):

- ``"towers"``: ``Towers`` with ``spec["placement"]`` and ``spec["reducer"]``;
- ``"single"``: the plain single-device step itself (an A/A run: its ratio is
  this machine's noise floor);
- ``"naive"``: the TF1 tutorials' loop (``average_gradients`` on the CPU);
- ``"mirrored"``: ``tf.distribute.MirroredStrategy`` over the same devices;
- ``"central_storage"``: ``tf.distribute.experimental.CentralStorageStrategy``,
  variables on the CPU, compute on the same devices.

With ``spec["jit_compile"]`` the contender (towers, or the single-device step)
compiles with XLA, and the single-device step with XLA is timed in the same
rounds too (``single_device_xla_ms``, ``vs_single_device_xla``). The
strategies have no XLA variant: Keras turns XLA off under tf.distribute.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

CONTENDERS = ("towers", "single", "naive", "mirrored", "central_storage")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from towers.devices import virtual_devices

    if spec.get("virtual"):
        virtual_devices(spec["virtual"], kind=spec.get("kind", "CPU"))
    print(json.dumps(measure(spec)), flush=True)
    return 0


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Times one configuration; returns its record (see ``towers/bench/run.py``).

    The contender, the plain single-device step and, with more than one tower,
    the zero-sync floor are timed in turns, round by round.
    """
    import keras
    import tensorflow as tf

    from towers.bench.peers import floor_step, single_device_step
    from towers.bench.presets import get_preset
    from towers.bench.timing import interleaved, ratio

    keras.utils.set_random_seed(0)
    preset = get_preset(spec["preset"])
    devices = spec["devices"]
    global_batch = spec["batch"] * len(devices)
    x, y = (tf.constant(a) for a in preset.batch(global_batch, seed=0))
    single = single_device_step(preset.build, preset.loss(), devices[0])
    contender, extra = _contender(spec, preset, devices, x, y)
    steps = {"contender": contender, "single": lambda: single(x, y)}
    if spec.get("jit_compile"):
        compiled = single_device_step(preset.build, preset.loss(), devices[0], True)
        steps["single_xla"] = lambda: compiled(x, y)
    if len(devices) > 1:
        steps["floor"] = floor_step(preset, devices, x, y)
    rounds = max(2, spec["steps"] // 10)
    times = interleaved(steps, rounds, max(1, spec["steps"] // rounds))
    timed = ratio(times, "contender", "single")
    record = {
        "step_ms": timed["contender_ms"],
        "single_device_ms": timed["baseline_ms"],
        **_ratios(timed, "vs_single_device"),
        "global_batch": global_batch,
        "examples_per_second": global_batch / (timed["contender_ms"] / 1e3),
    }
    if "single_xla" in times:
        xla = ratio(times, "contender", "single_xla")
        record["single_device_xla_ms"] = xla["baseline_ms"]
        record.update(_ratios(xla, "vs_single_device_xla"))
    if "floor" in times:
        floor = ratio(times, "contender", "floor")
        record["floor_ms"] = floor["baseline_ms"]
        record.update(_ratios(floor, "vs_floor"))
        record["floor_vs_single_device"] = ratio(times, "floor", "single")["ratio"]
    if "engine" in extra:
        record.update(_phases_and_bytes(extra.pop("engine"), x, y, spec))
    record.update(extra)
    return record


def _ratios(timed: dict[str, float], name: str) -> dict[str, float]:
    return {
        name: timed["ratio"],
        f"{name}_q25": timed["ratio_q25"],
        f"{name}_q75": timed["ratio_q75"],
    }


def _contender(spec, preset, devices, x, y):
    import keras

    from towers.bench.peers import naive_step, single_device_step, strategy_step
    from towers.engine import Towers

    kind, jit_compile = spec["contender"], bool(spec.get("jit_compile"))
    if kind == "single":
        step = single_device_step(preset.build, preset.loss(), devices[0], jit_compile)
        return (lambda: step(x, y)), {}
    if kind == "naive":
        return naive_step(preset, devices, x, y), {}
    if kind in ("mirrored", "central_storage"):
        return strategy_step(kind, preset, devices, x, y), {}
    engine = Towers(
        preset.build,
        preset.loss(),
        lambda: keras.optimizers.SGD(0.01),
        devices=devices,
        placement=spec["placement"],
        reducer=spec["reducer"],
        variable_device=spec.get("variable_device", "/cpu:0"),
        jit_compile=jit_compile,
    )
    return (lambda: engine.train_step(x, y)), {"engine": engine}


def _phases_and_bytes(engine, x, y, spec) -> dict[str, Any]:
    """Phase times, gradient bytes, bandwidths, and where the variables lived."""
    from towers.bench.phases import gradient_bytes, time_phases
    from towers.placement.base import bytes_by_device

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

"""The price of exact BatchNormalization: batch_statistics="global" vs "tower".

The bench's ResNet preset (BatchNormalization after every convolution), global
batch 64, SGD, logical CPU devices. Four steps run in this process, in turns,
round by round: towers normalising with each shard's statistics ("tower"),
towers normalising with the whole batch's ("global": the towers are traced in
lockstep and exchange each layer's partial sums forward and backward), the
zero-sync floor (the same shards, a model copy per device normalising its own
shard, nothing combined: ``placement="independent"``) and the plain
single-device step. No target: the issue asks for the price, reported.

With XLA (``jit_compile=True``), global statistics cut each tower's pass into
phases where the towers meet, one XLA computation each
(``towers/step/run/phases.py``): timed beside the same step without XLA, tower
statistics with XLA (one computation per tower), the zero-sync floor with XLA
and the single-device step with XLA. No target on a CPU, where XLA is not
always faster.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.peers import floor_step, single_device_step
from towers.bench.presets import get_preset
from towers.bench.timing import interleaved, ratio

BATCH = 64


def towers_steps(preset, devices, x, y, contenders: dict) -> dict:
    """By name, a step of ``Towers`` with the contender's ``(batch_statistics,
    jit_compile)``, returning its loss."""
    steps = {}
    for name, (statistics, jit_compile) in contenders.items():
        engine = Towers(
            preset.build,
            preset.loss(),
            lambda: keras.optimizers.SGD(0.01),
            devices=devices,
            batch_statistics=statistics,
            jit_compile=jit_compile,
        )
        steps[name] = lambda engine=engine: engine.train_step(x, y)["loss"]
    return steps


@pytest.mark.parametrize("num_towers", [2, 4])
def test_global_batch_statistics_vs_tower_statistics(benchmark, num_towers):
    preset = get_preset("resnet")
    x, y = (tf.constant(a) for a in preset.batch(BATCH, seed=0))
    devices = [f"/cpu:{t}" for t in range(num_towers)]
    steps = towers_steps(
        preset, devices, x, y, {"tower": ("tower", False), "global": ("global", False)}
    )
    single = single_device_step(preset.build, preset.loss(), "/cpu:0")
    steps["single"] = lambda: single(x, y)
    steps["floor"] = floor_step(preset, devices, x, y)

    times = interleaved(steps, rounds=8, steps_per_round=4, warmup=2)

    assert np.isfinite(float(steps["global"]()))
    name = f"resnet {num_towers}-tower step"
    record_ratio(
        benchmark,
        f"{name}, global / tower batch statistics",
        ratio(times, "global", "tower"),
        None,
        steps["global"],
        num_towers=num_towers,
        batch=BATCH,
    )
    for statistics in ("tower", "global"):
        record_ratio(
            benchmark,
            f"{name}, {statistics} statistics / zero-sync floor",
            ratio(times, statistics, "floor"),
            None,
        )
    record_ratio(
        benchmark,
        f"resnet {num_towers}-tower floor / single-device step",
        ratio(times, "floor", "single"),
        None,
    )


@pytest.mark.parametrize("num_towers", [2, 4])
def test_global_batch_statistics_with_xla(benchmark, num_towers):
    preset = get_preset("resnet")
    x, y = (tf.constant(a) for a in preset.batch(BATCH, seed=0))
    devices = [f"/cpu:{t}" for t in range(num_towers)]
    contenders = {
        "global xla": ("global", True),
        "global": ("global", False),
        "tower xla": ("tower", True),
    }
    steps = towers_steps(preset, devices, x, y, contenders)
    single = single_device_step(preset.build, preset.loss(), "/cpu:0", True)
    steps["single xla"] = lambda: single(x, y)
    steps["floor xla"] = floor_step(preset, devices, x, y, jit_compile=True)

    times = interleaved(steps, rounds=8, steps_per_round=4, warmup=2)

    assert np.isfinite(float(steps["global xla"]()))
    name = f"resnet {num_towers}-tower step, global statistics xla"
    record_ratio(
        benchmark,
        f"{name} / without xla",
        ratio(times, "global xla", "global"),
        None,
        steps["global xla"],
        num_towers=num_towers,
        batch=BATCH,
    )
    for baseline in ("tower xla", "floor xla", "single xla"):
        record_ratio(
            benchmark,
            f"{name} / {baseline}",
            ratio(times, "global xla", baseline),
            None,
        )

"""Placements against the plain single-device step and the zero-sync floor.

The mlp preset on 4 logical CPU towers (batch 64 per tower): each placement's
step, the single-device step and the floor timed in turns in this process. The
issue sets no target for these; the ratios are recorded and printed with the
others. (The tf.distribute strategies and the TF1 loop run each in a process of
its own: bench_peers.py.)
"""

import keras
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.peers import floor_step, single_device_step
from towers.bench.presets import get_preset
from towers.bench.timing import interleaved, ratio

NUM_TOWERS = 4
DEVICES = [f"/device:CPU:{t}" for t in range(NUM_TOWERS)]
PLACEMENTS = ["central", "balanced", "replicated"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_placement_vs_single_device_and_floor(benchmark, placement):
    preset = get_preset("mlp")
    x, y = (tf.constant(a) for a in preset.batch(64 * NUM_TOWERS, 0))
    single = single_device_step(preset.build, preset.loss(), DEVICES[0])
    engine = Towers(
        preset.build,
        preset.loss(),
        lambda: keras.optimizers.SGD(0.01),
        devices=DEVICES,
        placement=placement,
    )
    steps = {
        "towers": lambda: engine.train_step(x, y)["loss"],
        "single": lambda: single(x, y),
        "floor": floor_step(preset, DEVICES, x, y),
    }

    times = interleaved(steps)

    record_ratio(
        benchmark,
        f"4-tower mlp, {placement} / single device",
        ratio(times, "towers", "single"),
        None,
        steps["towers"],
        placement=placement,
    )
    record_ratio(
        benchmark,
        f"4-tower mlp, {placement} / zero-sync floor",
        ratio(times, "towers", "floor"),
        None,
    )

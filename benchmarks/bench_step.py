"""The T-tower step against the plain single-device step and the zero-sync floor.

MLP 784-512-512-10, global batch 256, SGD, logical CPU devices. The towers step,
the single-device step and the floor (the same shards, a model copy per device,
each applying its own gradients, nothing combined: ``placement="independent"``)
run in this process, in turns, round by round.

``step / single`` says what this machine charges for splitting the batch at all
(small matmuls on shared cores); it is reported, with no target, because it is
the machine's more than the engine's. The targets (issue 16) are on what the
engine adds:

- 1 tower: ``step / single <= 1.02`` (the engine's fixed cost);
- T towers: ``step / floor`` (the sync overhead) <= 1.02, 1.05, 1.10 at 2, 4, 8.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.peers import floor_step, single_device_step
from towers.bench.presets import build_mlp, get_preset
from towers.bench.timing import interleaved, ratio

BATCH = 256
FIXED_COST_TARGET = 1.02
OVERHEAD_TARGETS = {2: 1.02, 4: 1.05, 8: 1.10}


def batch():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 784)), tf.float32)
    y = tf.constant(rng.integers(0, 10, BATCH), tf.int32)
    return x, y


@pytest.mark.parametrize("num_towers", [1, 2, 4, 8])
def test_towers_step_vs_single_device_and_floor(benchmark, num_towers):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = batch()
    devices = [f"/cpu:{t}" for t in range(num_towers)]
    single = single_device_step(build_mlp, loss, "/cpu:0")
    engine = Towers(
        build_mlp, loss, lambda: keras.optimizers.SGD(0.01), devices=devices
    )
    steps = {
        "towers": lambda: engine.train_step(x, y)["loss"],
        "single": lambda: single(x, y),
    }
    if num_towers > 1:
        steps["floor"] = floor_step(get_preset("mlp"), devices, x, y)

    times = interleaved(steps)

    name = f"{num_towers}-tower step"
    fixed = FIXED_COST_TARGET if num_towers == 1 else None
    record_ratio(
        benchmark,
        f"{name} / single-device step",
        ratio(times, "towers", "single"),
        fixed,
        steps["towers"],
        num_towers=num_towers,
        batch=BATCH,
    )
    if num_towers > 1:
        record_ratio(
            benchmark,
            f"{name} / zero-sync floor",
            ratio(times, "towers", "floor"),
            OVERHEAD_TARGETS[num_towers],
        )
        record_ratio(
            benchmark,
            f"{num_towers}-tower floor / single-device step",
            ratio(times, "floor", "single"),
            None,
        )

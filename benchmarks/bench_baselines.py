"""Placements and tf.distribute baselines against the plain single-device step.

The same comparisons `towers bench` makes, as pytest-benchmark records: the mlp
preset on 4 logical CPU towers (batch 64 per tower), each contender timed against
the single-device step on the same global batch in alternating rounds, in this
process. The issue sets no target for these; the ratios are recorded in
extra_info and printed with the others.
"""

import keras
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.measure import single_device_step, strategy_step
from towers.bench.presets import get_preset
from towers.bench.timing import interleaved_ratio

NUM_TOWERS = 4
DEVICES = [f"/device:CPU:{t}" for t in range(NUM_TOWERS)]
CONTENDERS = ["central", "balanced", "replicated", "independent"]
STRATEGIES = ["mirrored", "central_storage"]


@pytest.mark.parametrize("contender", CONTENDERS + STRATEGIES)
def test_contender_vs_single_device(benchmark, contender):
    preset = get_preset("mlp")
    x, y = (tf.constant(a) for a in preset.batch(64 * NUM_TOWERS, 0))
    single = single_device_step(preset.build, preset.loss(), DEVICES[0])
    if contender in STRATEGIES:
        step = strategy_step(contender, preset, DEVICES, x, y)
    else:
        engine = Towers(
            preset.build,
            preset.loss(),
            lambda: keras.optimizers.SGD(0.01),
            devices=DEVICES,
            placement=contender,
        )

        def step():
            return engine.train_step(x, y)["loss"]

    result = interleaved_ratio(step, lambda: single(x, y))
    record_ratio(
        benchmark,
        f"4-tower mlp, {contender} / single device",
        result,
        None,
        lambda: {"loss": step()},
        contender=contender,
        num_towers=NUM_TOWERS,
    )

"""The T-tower step against the plain single-device step, same model, same batch.

MLP 784-512-512-10, global batch 256, SGD, logical CPU devices. Both steps run in
this process, in alternating rounds; the ratio is towers / single device.
Targets (issue 2): 2 towers <= 1.02, 4 towers <= 1.10, 8 towers <= 1.25.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.measure import single_device_step
from towers.bench.presets import build_mlp
from towers.bench.timing import interleaved_ratio

BATCH = 256
TARGETS = {2: 1.02, 4: 1.10, 8: 1.25}


def batch():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 784)), tf.float32)
    y = tf.constant(rng.integers(0, 10, BATCH), tf.int32)
    return x, y


@pytest.mark.parametrize("num_towers", [2, 4, 8])
def test_towers_step_vs_single_device(benchmark, num_towers):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = batch()
    single = single_device_step(build_mlp, loss, "/cpu:0")
    engine = Towers(
        build_mlp,
        loss,
        lambda: keras.optimizers.SGD(0.01),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
    )

    result = interleaved_ratio(lambda: engine.train_step(x, y), lambda: single(x, y))
    record_ratio(
        benchmark,
        f"{num_towers}-tower step / single-device step",
        result,
        TARGETS[num_towers],
        lambda: engine.train_step(x, y),
        num_towers=num_towers,
        batch=BATCH,
    )

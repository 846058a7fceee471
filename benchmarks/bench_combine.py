"""Combine bandwidth: 4 towers x 25 M float32 gradients against memory bandwidth.

Target (issue 4): the combine reaches >= 0.70 of memory bandwidth. Bandwidth is
one TensorFlow elementwise pass (read + write) over the same bytes, measured in
this process; the combine is credited with the least it must touch, (T+1)*P*4
bytes (read T gradients, write one sum). Both move the same bytes, so the
bandwidth fraction is elementwise time / combine time, and the time ratio
reported (combine / elementwise, lower is better) must be <= 1 / 0.70.

The 160 gradients have ResNet-50-like sizes (a few large, many small), on 4
logical CPU devices, summed on a fifth.
"""

import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import combine_gradients
from towers.bench.timing import interleaved_ratio
from towers.reducers import PerTensor

NUM_TOWERS = 4
PARAMS = 25_000_000
NUM_TENSORS = 160
TARGET = 1 / 0.70


def gradient_sizes() -> list[int]:
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.0, NUM_TENSORS) + 0.01
    sizes = np.maximum(1, (weights / weights.sum() * PARAMS).astype(int))
    sizes[-1] += PARAMS - sizes.sum()
    return [int(s) for s in sizes]


@pytest.fixture(scope="module")
def tower_grads():
    grads = []
    for t in range(NUM_TOWERS):
        with tf.device(f"/cpu:{t + 1}"):
            grads.append([tf.random.normal([n], seed=t) for n in gradient_sizes()])
    return grads


@pytest.mark.parametrize(
    "name, reducer, reduction",
    [
        ("per_tensor sum", PerTensor(), "sum"),
        ("per_tensor mean", PerTensor(), "mean"),
        ("per_tensor sum, XLA-fused", PerTensor(fuse_bytes=0), "sum"),
    ],
)
def test_combine_bandwidth(benchmark, tower_grads, name, reducer, reduction):
    with tf.device("/cpu:0"):
        # The same bytes as the combine: (T+1)*P floats, half read, half written.
        block = tf.random.normal([(NUM_TOWERS + 1) * PARAMS // 2])

    @tf.function
    def combine_all():
        with tf.device("/cpu:0"):
            return combine_gradients(tower_grads, reduction, reducer=reducer)

    def combine():
        # Every sum is an output, so none is pruned; the call returns when all
        # are computed, and reading one back makes sure of it.
        return combine_all()[0]

    @tf.function
    def elementwise():
        with tf.device("/cpu:0"):
            return block * 2.0

    result = interleaved_ratio(combine, elementwise, rounds=6, steps=3, warmup=2)
    result["bandwidth_fraction"] = 1 / result["ratio"]
    record_ratio(
        benchmark,
        f"combine 4x25M {name} / elementwise",
        result,
        TARGET,
        lambda: {"loss": combine()},
        towers=NUM_TOWERS,
        params=PARAMS,
    )

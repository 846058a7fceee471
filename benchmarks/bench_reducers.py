"""Reducers in the full step: packed and sharded against per-tensor.

Same MLP and batch as bench_step.py, 8 towers (the most gradients to combine),
each reducer's step and the per-tensor step timed in alternating rounds in this
process. Target (issue 4): packed is never slower than per-tensor (ratio <= 1.0).
Sharded and bf16+packed are reported for comparison; on one CPU host there is no
link to save, so their targets only say "no worse than 10 % slower".
"""

import keras
import pytest

from benchmarks.bench_step import batch, build_mlp
from benchmarks.conftest import record_ratio
from towers.bench.timing import interleaved_ratio
from towers import Towers

NUM_TOWERS = 8
TARGETS = {"packed": 1.0, "sharded": 1.10, "bf16+packed": 1.10}


def engine_with(reducer):
    return Towers(
        build_mlp,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.01),
        devices=[f"/cpu:{t}" for t in range(NUM_TOWERS)],
        reducer=reducer,
    )


@pytest.mark.parametrize("reducer", sorted(TARGETS))
def test_reducer_step_vs_per_tensor_step(benchmark, reducer):
    x, y = batch()
    contender, reference = engine_with(reducer), engine_with("per_tensor")

    result = interleaved_ratio(
        lambda: contender.train_step(x, y), lambda: reference.train_step(x, y)
    )
    record_ratio(
        benchmark,
        f"8-tower step, {reducer} / per_tensor",
        result,
        TARGETS[reducer],
        lambda: contender.train_step(x, y),
        reducer=reducer,
        num_towers=NUM_TOWERS,
    )

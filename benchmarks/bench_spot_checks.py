"""What the check costs through a run (issue 76): spot checks (``Towers(
spot_checks=2000)``, the default: one device's step compared at steps 200,
2000, 4000...) and each step's look for a new trace of the step.

MLP 784-512-512-10, global batch 256, SGD, 2 logical CPU towers. A step
here varies by +-5 % from one block of steps to the next (two engines, or
one with its checks on and off in turns, measured 1.02-1.07 apart with
nothing to tell them apart), more than the cost sought; so each part is
timed on its own: the step without checks, the look each step makes (over
many calls), and a spot check (one device's step, the state kept, compared,
put back). Over ``spot_checks`` steps the run then costs::

    (N * (step + look) + (check - step)) / (N * step)

Target: within 2 % of the step without checks.
"""

import time

import keras
import numpy as np

from benchmarks.bench_step import batch
from benchmarks.conftest import RESULTS
from towers import Towers
from towers.bench.presets import build_mlp
from towers.bench.timing import interleaved
from towers.training.check import checked
from towers.training.check_schedule import SPOT_CHECKS

TARGET = 1.02
LOOKS = 2000


def test_spot_checks_cost_on_the_steady_step(benchmark):
    x, y = batch()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = Towers(
        build_mlp, loss, lambda: keras.optimizers.SGD(0.01),
        devices=["/cpu:0", "/cpu:1"],
    )  # fmt: skip

    engine.checks.spot_checks = None  # each part timed apart, below
    times = interleaved({"step": lambda: engine.train_step(x, y)["loss"]})
    prepared = [engine._training_batch("train_step", x, y, None)]
    started = time.perf_counter()
    for _ in range(LOOKS):
        engine.checks.due(prepared)
    look = (time.perf_counter() - started) / LOOKS
    checks = []
    for _ in range(7):
        started = time.perf_counter()
        checked(engine, prepared, lambda: engine._run_steps(prepared), keep=False)
        checks.append(time.perf_counter() - started)
    step, every = np.asarray(times["step"]), SPOT_CHECKS
    check = float(np.median(checks))
    runs = (every * (step + look) + (check - step)) / (every * step)
    result = {
        "contender_ms": 1e3 * float(np.median(step + look + (check - step) / every)),
        "baseline_ms": 1e3 * float(np.median(step)),
        "ratio": float(np.median(runs)),
        "ratio_q25": float(np.percentile(runs, 25)),
        "ratio_q75": float(np.percentile(runs, 75)),
    }
    benchmark.extra_info["spot checks"] = {
        **result,
        "check_ms": 1e3 * check,
        "look_ms": 1e3 * look,
    }
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above
    RESULTS.append(
        {
            "name": f"checks on / off over {every} steps (2 towers)",
            **result,
            "target": TARGET,
        }
    )
    RESULTS.append(
        {
            "name": "  a spot check / a step",
            "contender_ms": 1e3 * check,
            "baseline_ms": 1e3 * float(np.median(step)),
            "ratio": check / float(np.median(step)),
            "ratio_q25": min(checks) / float(np.median(step)),
            "ratio_q75": max(checks) / float(np.median(step)),
            "target": None,
        }
    )

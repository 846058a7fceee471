"""Time to the first step on real models (issue 24): trace, graph optimisation
and one step, each contender in a fresh process (``towers/bench/first_step.py``),
in turns over 3 rounds.

Targets, MobileNetV2 (alpha 0.35) at 32x32, batch 32 on 4 towers: the first
step with global batch statistics within 1.5 x the one with tower statistics,
and that one within 2 x Keras' own fit's first step on one device. ResNet50 and
2 towers are reported beside them, without a target, and so is
MirroredStrategy's fit on the same devices against Keras' on one.
"""

import pytest

from benchmarks.conftest import RESULTS
from towers.bench.first_step import measure, ratio

CASES = [("MobileNetV2", 4), ("MobileNetV2", 2), ("ResNet50", 4), ("ResNet50", 2)]
ROUNDS = 3


@pytest.mark.parametrize("model, towers", CASES)
def test_first_step(benchmark, model, towers):
    times = measure(model, towers, ["keras", "tower", "global", "mirrored"], ROUNDS)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above
    benchmark.extra_info["seconds"] = times
    targeted = (model, towers) == ("MobileNetV2", 4)
    for contender, baseline, target in [
        ("tower", "keras", 2.0),
        ("global", "tower", 1.5),
        ("mirrored", "keras", None),
    ]:
        result = ratio(times, contender, baseline)
        RESULTS.append(
            {
                # The summary prints "ms": these are first steps of seconds.
                "name": f"first step {model} x{towers}: {contender} / {baseline}",
                **result,
                "target": target if targeted else None,  # None: compared only
            }
        )

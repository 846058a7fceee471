"""Ratios of step times measured side by side in one process (used by `towers bench`
and benchmarks/).

Shared, noisy machines make a lone time meaningless; a ratio of two steps timed in
alternating rounds cancels most of the noise both see.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def time_steps(step: Callable[[], object], steps: int) -> float:
    """Seconds per step over ``steps`` calls; the last result is read back."""
    started = time.perf_counter()
    for _ in range(steps):
        result = step()
    _read_back(result)
    return (time.perf_counter() - started) / steps


def interleaved_ratio(
    contender: Callable[[], object],
    baseline: Callable[[], object],
    rounds: int = 16,
    steps: int = 20,
    warmup: int = 5,
) -> dict[str, float]:
    """Median step times of both over alternating rounds, and the median of the
    rounds' contender / baseline ratios with its quartiles."""
    for step in (contender, baseline):
        for _ in range(warmup):  # traces, then settles allocators and thread pools
            _read_back(step())
    contender_times, baseline_times = [], []
    for r in range(rounds):
        # ABBA order: whichever runs first in a round pays for any warm-up the
        # other leaves behind, so the first place alternates.
        if r % 2 == 0:
            contender_times.append(time_steps(contender, steps))
            baseline_times.append(time_steps(baseline, steps))
        else:
            baseline_times.append(time_steps(baseline, steps))
            contender_times.append(time_steps(contender, steps))
    contender_s, baseline_s = np.median(contender_times), np.median(baseline_times)
    # Each round's pair saw the same machine state: the median of their ratios is
    # the ratio, and their spread is the noise a verdict must allow for (an A/A
    # run here spreads about +-4 %).
    ratios = np.divide(contender_times, baseline_times)
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return {
        "contender_ms": 1e3 * contender_s,
        "baseline_ms": 1e3 * baseline_s,
        "ratio": float(median),
        "ratio_q25": float(low),
        "ratio_q75": float(high),
    }


def _read_back(result: object) -> None:
    """Forces the step to finish: a value read to the host has been computed."""
    if isinstance(result, dict):
        result = next(iter(result.values()))
    if hasattr(result, "numpy"):
        result.numpy()

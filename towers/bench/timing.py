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


def interleaved(
    steps: dict[str, Callable[[], object]],
    rounds: int = 16,
    steps_per_round: int = 20,
    warmup: int = 5,
) -> dict[str, list[float]]:
    """Seconds per step of each of ``steps``, round by round, timed in turns.

    Each round times every step once; the order rotates from round to round, so
    whichever runs first (and pays for the warm-up another leaves behind) changes.
    Compare two steps with :func:`ratio`, which pairs their times round by round.
    """
    for step in steps.values():
        for _ in range(warmup):  # traces, then settles allocators and thread pools
            _read_back(step())
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            times[name].append(time_steps(steps[name], steps_per_round))
    return times


def round_order(names: list[str], r: int) -> list[str]:
    """The order :func:`interleaved` times ``names`` in round ``r``: rotated
    each round, reversed every other pass (ABBA), so no step always runs first.

    >>> [round_order(["a", "b"], r) for r in range(4)]
    [['a', 'b'], ['b', 'a'], ['b', 'a'], ['a', 'b']]
    >>> [round_order(["a", "b", "c"], r) for r in (0, 1, 3)]
    [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'b', 'a']]
    """
    order = names[r % len(names) :] + names[: r % len(names)]
    if (r // len(names)) % 2:
        order.reverse()
    return order


def ratio(times: dict[str, list[float]], contender: str, baseline: str) -> dict:
    """``contender / baseline``: the median of the rounds' ratios with their
    quartiles, and each one's median step time.

    >>> ratio({"a": [2.0, 4.0, 3.0], "b": [1.0, 2.0, 1.0]}, "a", "b")["ratio"]
    2.0
    """
    # Each round's pair saw the same machine state: the median of their ratios is
    # the ratio, and their spread is the noise a verdict must allow for (an A/A
    # run here spreads about +-4 %).
    ratios = np.divide(times[contender], times[baseline])
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return {
        "contender_ms": 1e3 * float(np.median(times[contender])),
        "baseline_ms": 1e3 * float(np.median(times[baseline])),
        "ratio": float(median),
        "ratio_q25": float(low),
        "ratio_q75": float(high),
    }


def interleaved_ratio(
    contender: Callable[[], object],
    baseline: Callable[[], object],
    rounds: int = 16,
    steps: int = 20,
    warmup: int = 5,
) -> dict[str, float]:
    """Two steps timed in alternating rounds: see :func:`ratio`."""
    times = interleaved(
        {"contender": contender, "baseline": baseline}, rounds, steps, warmup
    )
    return ratio(times, "contender", "baseline")


def _read_back(result: object) -> None:
    """Forces the step to finish: a value read to the host has been computed."""
    if isinstance(result, dict):
        result = next(iter(result.values()))
    if hasattr(result, "numpy"):
        result.numpy()

"""The step with and without XLA (``jit_compile``), beside the plain single-device
step with and without XLA and MirroredStrategy (issue 26).

The mlp preset (batch 64 per tower) at 2 and 4 logical CPU towers, through
``towers bench --xla``'s own runner: each contender runs in a fresh process that
times it beside the plain single-device step (and, for an XLA contender, the
single-device step with XLA) in turns. There is no speed target: on a CPU XLA
is not always faster (here it is often slower); GPUs are where it must win.
The ratios are printed with the spread of their rounds at the end of the run.
"""

import pytest

from benchmarks.conftest import RESULTS
from towers.bench.run import BenchOptions, choose_devices, run_bench

TOWER_COUNTS = [2, 4]


@pytest.fixture(scope="module")
def bench_result():
    options = BenchOptions(
        preset="mlp",
        towers=TOWER_COUNTS,
        baselines=["single", "mirrored"],
        batch=64,
        steps=60,
        xla=True,
    )
    devices, virtual, _ = choose_devices(max(TOWER_COUNTS), 0, virtual=True)
    return run_bench(options, devices, virtual)


def _record(result, contender, towers, jit_compile=False):
    for record in result["records"]:
        if (
            record["contender"] == contender
            and record["towers"] == towers
            and record.get("jit_compile", False) == jit_compile
        ):
            assert record["status"] == "ok", record["status"]
            return record
    raise AssertionError(f"no {contender} x{towers} (xla {jit_compile}) in the run")


def _across(name, mine, theirs):
    """A ratio of two processes' ratios to their own single-device step; the
    spread is the widest the two processes' quartiles allow."""
    key = "vs_single_device"
    return {
        "name": name,
        "contender_ms": mine["step_ms"],
        "baseline_ms": theirs["step_ms"],
        "ratio": mine[key] / theirs[key],
        "ratio_q25": mine[f"{key}_q25"] / theirs[f"{key}_q75"],
        "ratio_q75": mine[f"{key}_q75"] / theirs[f"{key}_q25"],
        "target": None,
    }


def _within(name, record, key, baseline_ms):
    """A ratio measured in one process, with its rounds' quartiles."""
    return {
        "name": name,
        "contender_ms": record["step_ms"],
        "baseline_ms": record[baseline_ms],
        "ratio": record[key],
        "ratio_q25": record[f"{key}_q25"],
        "ratio_q75": record[f"{key}_q75"],
        "target": None,
    }


def test_single_device_step_with_xla_vs_without(benchmark, bench_result):
    xla = _record(bench_result, "single", 1, jit_compile=True)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above
    benchmark.extra_info.update(single_xla=xla)
    RESULTS.append(
        _within(
            "1 device xla / 1 device (same process)",
            xla,
            "vs_single_device",
            "single_device_ms",
        )
    )
    assert xla["step_ms"] > 0 and xla["single_device_xla_ms"] > 0


@pytest.mark.parametrize("towers", TOWER_COUNTS)
def test_towers_step_with_xla_beside_single_device_and_mirrored(
    benchmark, bench_result, towers
):
    xla = _record(bench_result, "towers", towers, jit_compile=True)
    plain = _record(bench_result, "towers", towers)
    mirrored = _record(bench_result, "mirrored", towers)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above
    benchmark.extra_info.update(towers_xla=xla, towers=plain, mirrored=mirrored)
    RESULTS.extend(
        [
            _across(f"{towers}-tower towers xla / towers", xla, plain),
            _within(
                f"{towers}-tower towers xla / 1 device xla",
                xla,
                "vs_single_device_xla",
                "single_device_xla_ms",
            ),
            _across(f"{towers}-tower towers xla / mirrored", xla, mirrored),
        ]
    )
    # Each tower's pass is an XLA computation: the XLA step is not the plain one.
    assert xla["phases_ms"]["compute"] > 0 and xla["step_ms"] > 0

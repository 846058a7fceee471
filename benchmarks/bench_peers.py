"""towers against its peers, each in a process of its own (issue 16).

The mlp preset (batch 64 per tower) at 2, 4 and 8 logical CPU towers, through
``towers bench``'s own runner: every contender (towers, the TF1 tutorials'
``average_gradients`` loop, CentralStorageStrategy, MirroredStrategy) runs in a
fresh process that times it beside the plain single-device step and the
zero-sync floor in turns. Processes differ in their noise, so contenders are
compared by their ratios to their own process's single-device step: towers must
be ahead of each peer at every tower count (``towers / peer <= 1``).
"""

import pytest

from benchmarks.conftest import RESULTS
from towers.bench.run import BenchOptions, choose_devices, run_bench

TOWER_COUNTS = [2, 4, 8]
PEERS = ["naive", "central_storage", "mirrored"]


@pytest.fixture(scope="module")
def bench_result():
    options = BenchOptions(
        preset="mlp",
        towers=TOWER_COUNTS,
        baselines=PEERS,
        batch=64,
        steps=80,
    )
    devices, virtual, _ = choose_devices(max(TOWER_COUNTS), 0, virtual=True)
    return run_bench(options, devices, virtual)


def _record(result, contender, towers):
    for record in result["records"]:
        if record["contender"] == contender and record["towers"] == towers:
            assert record["status"] == "ok", record["status"]
            return record
    raise AssertionError(f"no {contender} x{towers} in the run")


@pytest.mark.parametrize("towers", TOWER_COUNTS)
@pytest.mark.parametrize("peer", PEERS)
def test_towers_is_ahead_of_each_peer(benchmark, bench_result, peer, towers):
    mine, theirs = (
        _record(bench_result, "towers", towers),
        _record(bench_result, peer, towers),
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above
    benchmark.extra_info.update(towers=mine, peer=theirs)
    # Ratios to each process's own single-device step; the spread is the widest
    # the two processes' quartiles allow.
    name = "vs_single_device"
    RESULTS.append(
        {
            "name": f"{towers}-tower towers / {peer} (each vs its own 1 device)",
            "contender_ms": mine["step_ms"],
            "baseline_ms": theirs["step_ms"],
            "ratio": mine[name] / theirs[name],
            "ratio_q25": mine[f"{name}_q25"] / theirs[f"{name}_q75"],
            "ratio_q75": mine[f"{name}_q75"] / theirs[f"{name}_q25"],
            "target": 1.0,
        }
    )

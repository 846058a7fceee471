"""Two local worker processes against one process with two towers (issue 5).

`towers bench --workers 2` as a pytest-benchmark record: the mlp preset, batch 64
per tower, one tower per worker on TensorFlow's collective runtime over loopback,
against one process with 2 towers on the same global batch. Both are timed in the
chief in alternating rounds; the target is a ratio <= 1.3. The record also holds
the cross-worker sum timed alone, which is what the gap is made of, and the CPU
floor: the workers' CPU per step over the cores they share, below which no step
can go on this machine.
"""

from benchmarks.conftest import RESULTS
from towers.bench.workers import TARGET, describe, run_workers


def test_two_workers_vs_one_process_two_towers(benchmark):
    records = []
    benchmark.pedantic(
        lambda: records.append(run_workers("mlp", workers=2, steps=50)),
        rounds=1,
        iterations=1,
    )
    record = records[0]
    benchmark.extra_info.update(record)
    RESULTS.append(
        {
            "name": "2 workers x 1 tower / 1 process x 2 towers",
            "contender_ms": record["cluster_ms"],
            "baseline_ms": record["one_process_ms"],
            "ratio": record["ratio"],
            "ratio_q25": record["ratio_q25"],
            "ratio_q75": record["ratio_q75"],
            "target": TARGET,
            "floor_ratio": record["cpu_floor_ratio"],
        }
    )
    print("\n" + describe(record))

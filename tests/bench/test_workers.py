"""towers bench --workers: a real 2-worker job on loopback, read back from JSON."""

import json
import subprocess
import sys

from towers.bench.presets import get_preset
from towers.bench.workers import describe, machine_cores


def test_bench_runs_two_workers_against_one_process(tmp_path):
    out = tmp_path / "workers.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "towers.cli", "bench", "--workers", "2",
            "--steps", "4", "--batch", "8", "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    model = get_preset("mlp").build()
    expected_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    assert record["gradient_bytes"] == expected_bytes == 669_706 * 4
    assert record["global_batch"] == 16 and record["target"] == 1.3
    assert record["ratio_q25"] <= record["ratio"] <= record["ratio_q75"]
    assert record["cluster_ms"] > 0 and record["one_process_ms"] > 0
    assert record["exchange_ms"] > 0
    assert "mlp: 2 workers x 1 tower(s)" in done.stdout
    assert f"ratio {record['ratio']:.3f}" in done.stdout

    # The CPU floor: each worker's process CPU per cluster step, over the cores
    # they share. CPU time spread over the cores cannot exceed the wall time it
    # was spent in, so the floor is below the slowest worker's step in that loop.
    assert record["cores"] == machine_cores() >= 1
    assert len(record["step_cpu_ms"]) == len(record["sum_cpu_ms"]) == 2
    assert all(ms > 0 for ms in record["step_cpu_ms"] + record["sum_cpu_ms"])
    floor = sum(record["step_cpu_ms"]) / record["cores"]
    assert record["cpu_floor_ms"] == floor <= 1.02 * max(record["step_wall_ms"])
    assert record["cpu_floor_ratio"] == floor / record["one_process_ms"]
    assert f"ratio >= {record['cpu_floor_ratio']:.2f}" in done.stdout


def _record(floor_ratio):
    return {
        "preset": "mlp", "workers": 2, "towers_per_worker": 1, "global_batch": 128,
        "cluster_ms": 12.0, "one_process_ms": 4.0, "ratio": 3.0, "ratio_q25": 2.9,
        "ratio_q75": 3.1, "target": 1.3, "gradient_bytes": 2_678_824,
        "exchange_ms": 8.0, "sum_cpu_ms": [6.0, 6.1], "step_cpu_ms": [9.0, 9.2],
        "cores": 2, "cpu_floor_ms": 4.0 * floor_ratio, "cpu_floor_ratio": floor_ratio,
    }  # fmt: skip


def test_describe_says_when_the_cpu_floor_puts_the_target_out_of_reach():
    out_of_reach = describe(_record(2.3))
    assert "MISSES the target <= 1.3" in out_of_reach
    assert "CPU per cluster step: 9.0 + 9.2 ms on 2 shared cores" in out_of_reach
    assert "ratio >= 2.30" in out_of_reach
    # The budget: 1.3 x 4.0 ms x 2 cores.
    assert "needs under 10.4 CPU ms per step" in out_of_reach
    within = describe(_record(1.1))
    assert "ratio >= 1.10" in within and "needs under" not in within

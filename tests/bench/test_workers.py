"""towers bench --workers: a real 2-worker job on loopback, read back from JSON."""

import json
import subprocess
import sys

from towers.bench.presets import get_preset


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

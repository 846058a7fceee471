"""`towers bench` end to end: real processes, a JSON file, a plot, bad input."""

import json
import subprocess
import sys

import pytest

from towers.bench.presets import get_preset
from towers.placement.base import variable_bytes


def bench(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "towers.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_writes_json_and_plot_with_every_field(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    done = bench(
        "--towers", "1,2", "--steps", "4", "--batch", "8",
        "--placement", "cpu,balanced", "--baselines", "single,naive,mirrored",
        "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    records = {
        (r["contender"], r.get("placement"), r["towers"]): r for r in result["records"]
    }
    assert sorted(records) == sorted(
        [
            ("single", None, 1),
            ("towers", "cpu", 1), ("towers", "balanced", 1), ("naive", None, 1),
            ("mirrored", None, 1),
            ("towers", "cpu", 2), ("towers", "balanced", 2), ("naive", None, 2),
            ("mirrored", None, 2),
        ]
    )  # fmt: skip
    assert all(r["status"] == "ok" for r in records.values())
    mlp_bytes = sum(
        variable_bytes(v) for v in get_preset("mlp").build().trainable_variables
    )
    two = records[("towers", "cpu", 2)]
    # Each tower hands the combine one dense gradient per variable.
    assert two["bytes_per_tower"] == mlp_bytes == 669_706 * 4
    assert two["global_batch"] == 16
    assert two["examples_per_second"] == pytest.approx(16 / (two["step_ms"] / 1e3))
    combine_s = two["phases_ms"]["combine"] / 1e3
    assert two["algbw_gbps"] == pytest.approx(mlp_bytes / combine_s / 1e9)
    assert two["busbw_gbps"] == pytest.approx(two["algbw_gbps"] * 2 * 1 / 2)
    assert two["topology"] == "reduce to /device:CPU:0 (a star, not a ring)"
    assert two["speedup"] == pytest.approx(
        two["examples_per_second"]
        / records[("towers", "cpu", 1)]["examples_per_second"]
    )
    # Balanced over 2 devices: both hold variables, the bytes add up.
    spread = records[("towers", "balanced", 2)]["variables_by_device"]
    assert len(spread) == 2 and sum(spread.values()) == mlp_bytes
    # With more than one tower every contender is timed against the zero-sync
    # floor too, in the same rounds; at one tower there is no floor to split.
    for (contender, _, towers), record in records.items():
        assert ("vs_floor" in record) == (towers > 1), (contender, towers)
        if towers > 1:
            assert (
                record["vs_floor_q25"] <= record["vs_floor"] <= record["vs_floor_q75"]
            )
            assert record["floor_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "towers cpu per_tensor" in done.stdout and "mirrored" in done.stdout


def test_bench_past_max_seconds_still_writes_what_it_has(tmp_path):
    out = tmp_path / "out.json"
    done = bench(
        "--towers", "1", "--baselines", "single", "--max-seconds", "0.5",
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 3
    assert "stopped at --max-seconds 0.5: 0 of 2 configurations finished" in done.stderr
    statuses = [r["status"] for r in json.loads(out.read_text())["records"]]
    assert statuses[0].startswith("timed out after")
    assert statuses[1] == "not run: --max-seconds reached"


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--reducer", "ring", "unknown reducer; received 'ring'"),
        ("--placement", "gpu", "unknown placement; received 'gpu', expected one of"),
        ("--baselines", "horovod", "unknown baseline; received 'horovod'"),
    ],
)
def test_bench_refuses_unknown_names_before_running(flag, value, expected):
    done = bench(flag, value, timeout=60)
    assert done.returncode == 2
    assert expected in done.stderr


def test_bench_predict_prints_the_published_checks():
    done = bench("--predict", "--compute-ms", "20", "--towers", "1,8", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Check 1: ResNet-50" in done.stdout and "1734" in done.stdout
    assert "nvlink-ring" in done.stdout

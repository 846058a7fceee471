"""towers bench --workers: a real 2-worker job on loopback, read back from JSON."""

import json
import subprocess
import sys

import numpy as np
import pytest

from towers.bench.presets import get_preset
from towers.bench.workers import cpu_floor, describe, machine_cores, verdict


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "workers.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "towers.cli", "bench", "--workers", "2",
            "--steps", "4", "--batch", "8", "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_the_job_measures_towers_and_its_exchange(bench):
    result, stdout = bench
    model = get_preset("mlp").build()
    expected_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    assert result["exchange"]["gradient_bytes"] == expected_bytes == 669_706 * 4
    assert result["exchange"]["ms"] > 0 and len(result["exchange"]["cpu_ms"]) == 2
    assert result["global_batch"] == 16 and result["cores"] == machine_cores() >= 1
    towers = result["towers"]
    assert towers["status"] == "ok" and towers["ms"] > 0
    for name in ("vs_single", "vs_one_process", "vs_floor"):
        assert towers[f"{name}_q25"] <= towers[name] <= towers[f"{name}_q75"]
    # Both workers end every round with the chief's weights.
    digests = towers["weights_digest"]
    assert len(digests) == 2 and len(set(digests)) == 1
    assert "mlp: 2 workers x 1 tower(s) on loopback, global batch 16" in stdout
    assert "towers vs its CPU floor" in stdout and f"{towers['vs_floor']:.3f}" in stdout


def test_the_cpu_floor_is_every_workers_cpu_over_the_cores(bench):
    result, _ = bench
    for name in ("towers", "mwms"):
        record = result[name]
        cpu = np.array(record["round_cpu_ms"])  # worker x round
        wall = np.max(record["round_wall_ms"], axis=0)
        assert cpu.shape == (2, len(record["round_vs_floor"])) and (cpu > 0).all()
        floor = cpu.sum(axis=0) / result["cores"]
        np.testing.assert_allclose(record["round_vs_floor"], wall / floor, rtol=1e-3)
        assert record["cpu_floor_ms"] == pytest.approx(np.median(floor))
        # CPU spread over the cores cannot exceed the wall time it was spent in.
        assert (floor <= 1.02 * wall).all()


def test_mwms_trains_the_same_model_in_the_same_processes(bench):
    result, stdout = bench
    mwms = result["mwms"]
    assert mwms["status"] == "ok" and mwms["ms"] > 0
    # MWMS all-reduced its gradients: both workers hold the same weights.
    assert len(set(mwms["weights_digest"])) == 1
    ratio = result["towers_vs_mwms"]
    assert ratio["ratio_q25"] <= ratio["ratio"] <= ratio["ratio_q75"]
    assert ratio["contender_ms"] == result["towers"]["ms"]  # the same rounds
    assert f"towers / mwms (timed in turns, same processes): {ratio['ratio']:.3f}" in (
        stdout
    )


def test_cpu_floor_folds_rounds_across_workers():
    lines = [
        {"round_cpu_ms": [9.0, 8.0, 10.0], "round_wall_ms": [10.0, 9.0, 12.0]},
        {"round_cpu_ms": [7.0, 8.0, 10.0], "round_wall_ms": [10.0, 9.6, 11.0]},
    ]
    floor = cpu_floor(lines, cores=2)
    assert floor["round_vs_floor"] == [1.25, 1.2, 1.2]
    assert floor["cpu_floor_ms"] == 8.0 and floor["vs_floor"] == 1.2
    assert floor["step_cpu_ms"] == [9.0, 8.0]


def test_verdicts_allow_for_the_spread():
    assert verdict(1.10, 1.05, 1.15) == "meets"
    assert verdict(1.20, 1.12, 1.15) == "within noise"
    assert verdict(1.25, 1.18, 1.15) == "MISSES"


def test_describe_shows_a_peer_that_failed_with_its_error():
    record = {
        "status": "ok", "ms": 12.0, "cpu_floor_ms": 10.0, "step_cpu_ms": [9.9, 10.1],
        "step_wall_ms": 12.1,
        **{f"{n}{q}": v for n, v in [("vs_floor", 1.2), ("vs_single", 3.0),
                                      ("vs_one_process", 2.9)]
           for q in ("", "_q25", "_q75")},
    }  # fmt: skip
    result = {
        "preset": "mlp", "workers": 2, "towers_per_worker": 1, "global_batch": 128,
        "cores": 2, "towers": record,
        "mwms": {"status": "failed: ValueError: no Keras 3 here"},
        "exchange": {"gradient_bytes": 2_678_824, "ms": 8.0, "cpu_ms": [6.0, 6.1]},
    }  # fmt: skip
    text = describe(result)
    assert "mwms    failed: ValueError: no Keras 3 here" in text
    assert "12.00  1.200 [1.200, 1.200]" in text
    assert (
        "12.10 ms/step while its workers spent 9.9 + 10.1 CPU ms on 2 cores "
        "(floor 10.00 ms): 1.200" in text
    )
    assert "target <= 1.15: MISSES" in text and "towers / mwms" not in text
    assert "6.0 + 6.1 CPU ms" in text

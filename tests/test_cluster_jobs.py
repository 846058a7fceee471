"""Multi-worker jobs with real processes on loopback (tests/scripts/cluster_train.py).

Each job ends by itself: the collectives carry timeouts, ``towers launch`` stops
the rest when one worker fails, and every subprocess has a timeout here too.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.tolerances import (
    EQUIVALENCE_ATOL,
    EQUIVALENCE_RTOL,
    MIXED_FLOAT16_RTOL,
)
from towers.launch import free_ports, tf_configs
from towers.preemption import PREEMPTED_EXIT_CODE

SCRIPT = str(Path(__file__).parent / "scripts" / "cluster_train.py")
ROOT = str(Path(__file__).parent.parent)


def run(args, env=None, timeout=180):
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def reference(out, *args):
    """One process with four towers on the whole batches."""
    out.mkdir()
    done = run([sys.executable, SCRIPT, "--out", str(out), "--towers", "4", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def launch(out, *args, workers=2):
    out.mkdir(exist_ok=True)
    return run(
        [
            sys.executable, "-m", "towers.cli", "launch", "--workers", str(workers),
            "--towers-per-worker", "2", "--",
            sys.executable, SCRIPT, "--out", str(out), *args,
        ]
    )  # fmt: skip


def weights(out, rank, name="weights"):
    with np.load(out / f"{name}-{rank}.npz") as saved:
        return [saved[key] for key in sorted(saved, key=lambda k: int(k[4:]))]


def result(out, rank):
    return json.loads((out / f"result-{rank}.json").read_text())


def assert_same_as(reference_out, out):
    for mine, theirs in zip(weights(out, 0), weights(reference_out, 0)):
        np.testing.assert_allclose(
            mine, theirs, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )
    # Every worker holds the same variables, to the bit.
    for w0, w1 in zip(weights(out, 0), weights(out, 1)):
        np.testing.assert_array_equal(w0, w1)


def test_two_workers_of_two_towers_train_as_one_process_of_four(tmp_path):
    ref = reference(tmp_path / "ref")
    job = launch(tmp_path / "job")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = tmp_path / "job"
    # Uneven batches (13, 7, 1, 10, 33): in the batch of 1, worker 1 has nothing.
    assert_same_as(ref, out)
    expected, got = result(ref, 0), [result(out, r) for r in (0, 1)]
    for worker in got:
        assert worker["steps"] == expected["steps"] == 5
        np.testing.assert_allclose(worker["losses"], expected["losses"], rtol=1e-6)
        # Metrics and evaluation are the cluster's, on every worker.
        assert worker["acc"] == expected["acc"]
        assert worker["evaluate"]["acc"] == expected["evaluate"]["acc"]
        np.testing.assert_allclose(
            worker["evaluate"]["loss"], expected["evaluate"]["loss"], rtol=1e-6
        )


def test_workers_that_build_different_models_stop_with_the_difference(tmp_path):
    started = time.monotonic()
    job = launch(tmp_path / "job", "--model", "wider", "--timeout", "20")
    output = job.stdout + job.stderr
    assert job.returncode != 0
    assert "the workers must build the same model; received" in output
    assert "(8, 5) on worker 1 where worker 0 has" in output or (
        "(8, 4) on worker 0 where worker 1 has" in output
    )
    # Compared before anything else is exchanged: no timeout was waited for.
    assert time.monotonic() - started < 60


def test_explaining_a_step_inside_a_cluster_reports_every_worker(tmp_path):
    job = launch(tmp_path / "job", "--mode", "explain")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    for rank in (0, 1):
        worker = result(tmp_path / "job", rank)
        report = worker["explain"]
        assert report["workers"] == 2
        assert "across workers" in report["stages"]
        assert report["collective_kinds"] == ["all-reduce"]
        assert "workers:         2; this is one worker's step" in report["text"]
        # The step ran, then every variable it touched was put back.
        assert worker["changed_by_explain"] == 0.0
        assert worker["steps"] == 1


def start_workers(out, *args, timeout):
    """Two workers started directly (no launcher), so each fails on its own."""
    out.mkdir(exist_ok=True)
    ports = free_ports(2)
    configs = tf_configs([f"127.0.0.1:{p}" for p in ports])
    return [
        subprocess.Popen(
            [
                sys.executable,
                SCRIPT,
                "--out",
                str(out),
                "--timeout",
                str(timeout),
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_CONFIG": config,
                "TOWERS_PER_WORKER": "2",
            },
        )  # fmt: skip
        for config in configs
    ]


def test_a_killed_worker_stops_the_others_and_a_relaunch_resumes(tmp_path):
    fit = ["--mode", "fit", "--every", "4"]
    ref = reference(tmp_path / "ref", *fit, "--checkpoint", str(tmp_path / "c0"))
    out, checkpoints = tmp_path / "job", str(tmp_path / "ckpt")
    timeout = 10
    chief, worker = start_workers(
        out, *fit, "--checkpoint", checkpoints, "--die-at", "9", timeout=timeout
    )
    try:
        worker_output, _ = worker.communicate(timeout=180)
        died = time.monotonic()
        chief_output, _ = chief.communicate(timeout=timeout + 60)
        waited = time.monotonic() - died
    finally:
        for process in (chief, worker):
            process.kill()
    assert worker.returncode == 9 and "worker 1 dies at step 9" in worker_output
    assert chief.returncode != 0
    assert "WorkerLostError: worker 0 of 2" in chief_output
    assert "cannot reach worker 1 (127.0.0.1:" in chief_output
    assert waited < timeout + 30  # the collective's timeout, plus exiting Python
    # The chief alone wrote checkpoints; the last was before step 9.
    saved = sorted(p.name for p in Path(checkpoints).glob("ckpt-*.index"))
    assert saved and all(int(name[5:-6]) < 9 for name in saved)

    job = launch(out, *fit, "--checkpoint", checkpoints, "--timeout", str(timeout))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(ref, out)
    for rank in (0, 1):
        resumed = result(out, rank)
        # No step lost or repeated: the same count as the uninterrupted run.
        assert resumed["steps"] == result(ref, 0)["steps"] == 14
        np.testing.assert_allclose(
            resumed["history"]["val_loss"][-1],
            result(ref, 0)["history"]["val_loss"][-1],
            rtol=1e-5,
        )
    assert job.stdout.count("Epoch 2/2") == 1  # progress from the chief only
    assert "[worker 0] Epoch 2/2" in job.stdout


@pytest.mark.parametrize("optimizer", ["sgd"])
def test_fit_in_a_cluster_reports_the_clusters_history(tmp_path, optimizer):
    ref = reference(tmp_path / "ref", "--mode", "fit", "--optimizer", optimizer)
    job = launch(tmp_path / "job", "--mode", "fit", "--optimizer", optimizer)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(ref, tmp_path / "job")
    expected = result(ref, 0)["history"]
    for rank in (0, 1):
        history = result(tmp_path / "job", rank)["history"]
        assert history.keys() == expected.keys()
        for name in expected:
            np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)


# The update policies on the cluster's summed gradients. --nan-in 3 puts a NaN in
# global batch 3 inside the last worker's share only: the chief must still see a
# non-finite sum and skip (or raise, or lower its loss scale) with the others.
UPDATE_POLICIES = {
    "accumulate": ["--accumulate", "2"],
    "skip": ["--nonfinite", "skip", "--nan-in", "3"],
    "raise": ["--nonfinite", "raise", "--nan-in", "3"],
    "mixed_float16": ["--policy", "mixed_float16", "--nan-in", "3"],
}


@pytest.mark.parametrize("policy", sorted(UPDATE_POLICIES))
def test_update_policies_in_a_cluster_match_one_process(tmp_path, policy):
    args = UPDATE_POLICIES[policy]
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = tmp_path / "job"
    expected = result(ref, 0)
    if policy == "mixed_float16":
        # 16-bit sums within the towers (tests/tolerances.py): compare each
        # variable's total change, relative to its size, as test_mixed_precision.
        changes = zip(weights(ref, 0, "start"), weights(out, 0), weights(ref, 0))
        for w0, mine, theirs in changes:
            error = np.linalg.norm((mine - w0) - (theirs - w0))
            assert error <= MIXED_FLOAT16_RTOL * np.linalg.norm(theirs - w0)
        for w0, w1 in zip(weights(out, 0), weights(out, 1)):
            np.testing.assert_array_equal(w0, w1)
    else:
        assert_same_as(ref, out)
    for rank in (0, 1):
        got = result(out, rank)
        # The same steps applied, skipped or refused as the one process.
        assert got["iterations"] == expected["iterations"]
        assert got["errors"] == expected["errors"]
        assert got.get("scale") == expected.get("scale")
        rtol = MIXED_FLOAT16_RTOL if policy == "mixed_float16" else 1e-6
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=rtol)
    accumulated = {"accumulate": 2, "skip": 4, "raise": 4, "mixed_float16": 4}
    assert expected["iterations"] == accumulated[policy]
    if policy == "raise":
        assert expected["errors"] and "is not finite" in expected["errors"][0]
    if policy == "mixed_float16":
        assert expected["scale"] == 2.0**14  # halved once, by the NaN step


@pytest.mark.parametrize(
    "args",
    [["--weighted"], ["--outputs", "2", "--weighted"]],
    ids=["sample-weights", "two-outputs-weighted"],
)
def test_what_keras_users_bring_trains_in_a_cluster_as_one_process(tmp_path, args):
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    out = tmp_path / "job"
    assert_same_as(ref, out)
    expected = result(ref, 0)
    for rank in (0, 1):
        got = result(out, rank)
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        np.testing.assert_allclose(
            got["evaluate"]["loss"], expected["evaluate"]["loss"], rtol=1e-5
        )


def test_a_preempted_worker_stops_every_worker_at_the_same_step(tmp_path):
    fit = ["--mode", "fit", "--every", "4"]
    ref = reference(tmp_path / "ref", *fit, "--checkpoint", str(tmp_path / "c0"))
    out, checkpoints = tmp_path / "job", tmp_path / "ckpt"
    chief, worker = start_workers(
        out, *fit, "--checkpoint", str(checkpoints), "--slow", timeout=30
    )
    try:
        for line in worker.stdout:  # the notice reaches worker 1 alone
            if line.strip() == "worker 1 trained step 5":
                worker.send_signal(signal.SIGTERM)
                break
        outputs = [p.communicate(timeout=120)[0] for p in (chief, worker)]
    finally:
        for process in (chief, worker):
            process.kill()
    assert chief.returncode == worker.returncode == PREEMPTED_EXIT_CODE
    # Both stopped after the same step (5, or 6 if the notice came after step 6's
    # sum had started), and the chief saved there.
    stops = [re.search(r"stopped after (epoch \d+ step \d+)", o) for o in outputs]
    assert stops[0] and stops[1] and stops[0][1] == stops[1][1]
    last = {
        int(re.findall(r"trained step (\d+)", o)[-1]) for o in [outputs[0], outputs[1]]
    }
    assert len(last) == 1 and last.pop() in (5, 6, 7)
    saved = max(int(p.name[5:-6]) for p in checkpoints.glob("ckpt-*.index"))
    assert f"trained step {saved}\n" in outputs[0] and saved >= 5

    job = launch(out, *fit, "--checkpoint", str(checkpoints))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(ref, out)
    for rank in (0, 1):  # no step lost or repeated
        assert result(out, rank)["steps"] == result(ref, 0)["steps"] == 14

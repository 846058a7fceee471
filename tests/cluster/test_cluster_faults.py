"""What a cluster job does under the faults a scheduler produces, with real worker
processes on loopback (tests/scripts/cluster_train.py): a killed worker, a
preempted one, a stopped one, a bad TF_CONFIG; and where the launched workers'
servers can be reached from. Each job ends by itself.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.cluster_jobs import (
    SCRIPT,
    assert_a_relaunch_resumes,
    assert_same_as,
    launch,
    launch_servers,
    listening_ports,
    processes_of,
    reference,
    result,
    run,
    start_launch,
    start_workers,
    steps_saved,
)
from towers.cluster.launch import free_ports, tf_configs
from towers.training.preemption import PREEMPTED_EXIT_CODE

# Each case waits for collectives to time out and for a peer's answer, timed in
# seconds: `make test` runs them alone, after the rest of the suite has run in
# parallel, so no other test's load stretches those waits.
pytestmark = pytest.mark.alone


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
    saved = [steps_saved(p) for p in Path(checkpoints).glob("ckpt-*.index")]
    assert saved and max(saved) < 9

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


@pytest.mark.parametrize("model", ["mlp", "twoapplies"], ids=["built_in", "own_step"])
def test_a_preempted_worker_stops_every_worker_at_the_same_step(tmp_path, model):
    # The notice rides in the step's sum: the built-in step's, or the packed
    # sum after a model's own step (with its metric changes). The relaunch
    # resumes at a batch of a row or two a worker: the own step's probe reads
    # its noise over 2n rows, the worker's batch's too, as blocks.
    fit = ["--mode", "fit", "--every", "4", "--model", model]
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
    saved = steps_saved(tf.train.latest_checkpoint(checkpoints))
    assert f"trained step {saved}\n" in outputs[0] and saved >= 5

    assert_a_relaunch_resumes(ref, out, *fit, "--checkpoint", str(checkpoints))


def test_a_stopped_worker_is_named_by_the_others_and_a_relaunch_resumes(tmp_path):
    fit = ["--mode", "fit", "--every", "4"]
    ref = reference(tmp_path / "ref", *fit, "--checkpoint", str(tmp_path / "c0"))
    out, checkpoints = tmp_path / "job", tmp_path / "ckpt"
    timeout = 10
    chief, worker = start_workers(
        out, *fit, "--checkpoint", str(checkpoints), "--slow", timeout=timeout
    )
    try:
        for line in worker.stdout:  # hangs, not dead: its sockets stay open
            if line.strip() == "worker 1 trained step 6":
                worker.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
                break
        chief_output, _ = chief.communicate(timeout=timeout + 60)
        waited = time.monotonic() - stopped
        assert worker.poll() is None  # still there, stopped
    finally:
        for process in (chief, worker):
            process.kill()  # a stopped process takes SIGKILL, as launch sends
        worker_output, _ = worker.communicate(timeout=60)
    # Both outputs whole, for a failure to point at. (This test failed 2 runs
    # in 10 with both cores busy: the chief crashed with SIGSEGV inside
    # TensorFlow's own collective timeout. The step's probe now aborts the
    # collectives first: 10 in 10; towers/cluster/faults.py, issue 35.)
    (tmp_path / "chief.log").write_text(chief_output)
    (tmp_path / "worker.log").write_text(worker_output)
    seen = f"chief exit code {chief.returncode}; whole outputs in {tmp_path}/*.log"
    assert chief.returncode != 0, seen
    assert "WorkerLostError: worker 0 of 2" in chief_output, (
        f"{seen}; its end: {chief_output[-3000:]}"
    )
    assert re.search(
        r"no answer from worker 1 \(127\.0\.0\.1:\d+: accepts connections but its "
        r"server did not answer in 2\.0 s\); it is stopped \(SIGSTOP",
        chief_output,
    ), chief_output[-3000:]
    assert "cannot reach" not in chief_output
    assert waited < timeout + 30  # the collective's timeout, the probe, exiting
    saved = steps_saved(tf.train.latest_checkpoint(checkpoints))
    assert 4 <= saved <= 7

    assert_a_relaunch_resumes(ref, out, *fit, "--checkpoint", str(checkpoints))


def bad_configs(busy_port):
    free = [f"127.0.0.1:{p}" for p in free_ports(2)]
    return {
        "malformed JSON": ("{not json", "TF_CONFIG must be JSON; received '{not json'"),
        "index out of range": (
            tf_configs(free)[0].replace('"index": 0', '"index": 2'),
            "must be in 0..1 for the 2 'worker' tasks; received 2",
        ),
        "port in use": (
            tf_configs([f"127.0.0.1:{busy_port}", free[1]])[0],
            f"worker 0's port {busy_port} (127.0.0.1:{busy_port}, from TF_CONFIG) "
            "is in use",
        ),
    }


@pytest.mark.parametrize(
    "case", ["malformed JSON", "index out of range", "port in use"]
)
def test_a_bad_tf_config_stops_the_worker_saying_what_is_wrong(tmp_path, case):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config, says = bad_configs(busy.getsockname()[1])[case]
        started = time.monotonic()
        job = run(
            [sys.executable, SCRIPT, "--out", str(tmp_path), "--timeout", "20"],
            env={"TF_CONFIG": config, "TOWERS_PER_WORKER": "2"},
            timeout=120,
        )
    assert job.returncode != 0
    assert says in job.stderr, job.stderr[-3000:]
    # Refused before any collective or timeout was waited for; nothing trained.
    assert time.monotonic() - started < 60
    assert not list(tmp_path.iterdir())


# A worker that starts TensorFlow's server from TF_CONFIG, says where, and waits.
SERVE = (
    "import os, sys, time, towers; c = towers.Cluster.from_tf_config().start(); "
    "print('serving', c.address.split(':')[1], os.readlink('/proc/self/ns/net'), "
    "flush=True); time.sleep(4)"
)


@pytest.mark.parametrize("network", ["private", "host"])
def test_where_the_launched_workers_servers_listen(network):
    job, served = launch_servers(network, SERVE)
    listening = listening_ports()
    refused = []
    for port in served:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            refused.append(port)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    if network == "private":
        # Nothing on this machine's network listens on the job's ports.
        assert not set(served) & set(listening) and sorted(refused) == sorted(served)
    else:
        # TensorFlow's server listens on every interface (its address is fixed
        # in its source): what --network private is for.
        every = {"00000000", "00000000000000000000000000000000"}
        assert {listening[port] for port in served} <= every and not refused


def read_until(stream, wanted):
    """The lines of ``stream`` up to and with the one that is ``wanted``."""
    lines = []
    for line in stream:
        lines.append(line)
        if line.strip() == wanted:
            return lines
    raise AssertionError(f"never printed {wanted!r}: {''.join(lines)[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_worker_at_one_step_and_saves(
    tmp_path, sig
):
    fit = ["--mode", "fit", "--every", "4"]
    ref = reference(tmp_path / "ref", *fit, "--checkpoint", str(tmp_path / "c0"))
    out, checkpoints = tmp_path / "job", tmp_path / "ckpt"
    job = start_launch(out, *fit, "--checkpoint", str(checkpoints), "--slow")
    try:
        before = read_until(job.stdout, "[worker 1] worker 1 trained step 5")
        job.send_signal(sig)
        rest, said = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == PREEMPTED_EXIT_CODE, said[-3000:]
    assert f"towers launch: {sig.name}; passing SIGTERM on to 2 worker(s)" in said
    assert processes_of(out) == []  # nothing orphaned
    lines = "".join(before) + rest
    stops = re.findall(r"\[worker (\d)\] .*stopped after (epoch \d+ step \d+)", lines)
    assert sorted(w for w, _ in stops) == ["0", "1"], lines[-3000:]
    assert stops[0][1] == stops[1][1]  # the same step
    last = int(re.findall(r"trained step (\d+)", lines)[-1])
    saved = steps_saved(tf.train.latest_checkpoint(checkpoints))
    assert saved == last and 5 <= saved <= 8

    assert_a_relaunch_resumes(ref, out, *fit, "--checkpoint", str(checkpoints))


def test_workers_of_a_killed_launcher_stop_as_preempted_and_a_relaunch_resumes(
    tmp_path,
):
    fit = ["--mode", "fit", "--every", "4"]
    ref = reference(tmp_path / "ref", *fit, "--checkpoint", str(tmp_path / "c0"))
    out, checkpoints = tmp_path / "job", tmp_path / "ckpt"
    job = start_launch(out, *fit, "--checkpoint", str(checkpoints), "--slow")
    try:
        read_until(job.stdout, "[worker 1] worker 1 trained step 5")
        assert len(processes_of(out)) == 2
        job.send_signal(signal.SIGKILL)  # nothing can be passed on
        job.wait(timeout=30)
        deadline = time.monotonic() + 60
        while processes_of(out) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        job.kill()
    assert processes_of(out) == []  # they stopped by themselves...
    # ...soon, not after training on to the end (14 steps), and saved.
    assert not (out / "result-0.json").exists()
    saved = steps_saved(tf.train.latest_checkpoint(checkpoints))
    assert 5 <= saved <= 8

    assert_a_relaunch_resumes(ref, out, *fit, "--checkpoint", str(checkpoints))


def test_a_worker_whose_peer_never_starts_says_whom_it_waits_for_then_gives_up(
    tmp_path,
):
    # Started directly, as a scheduler does: worker 1's port is taken, so it
    # exits at once; worker 0 must not wait in silence.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        addresses = [f"127.0.0.1:{free_ports(1)[0]}", f"127.0.0.1:{port}"]
        started = time.monotonic()
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    SCRIPT,
                    "--out",
                    str(tmp_path / str(rank)),
                    "--mode",
                    "fit",
                    "--startup-timeout",
                    "20",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={
                    **os.environ,
                    "TF_CONFIG": config,
                    "TOWERS_PER_WORKER": "2",
                    "TF_CPP_MIN_LOG_LEVEL": "2",
                },
            )
            for rank, config in enumerate(tf_configs(addresses))
        ]
        try:
            said = []
            for line in workers[0].stdout:
                said.append((time.monotonic() - started, line))
            workers[0].wait(timeout=60)
            lost_output = workers[1].communicate(timeout=60)[0]
        finally:
            for worker in workers:
                worker.kill()
    assert workers[1].returncode != 0 and f"port {port}" in lost_output
    notices = [
        (at, line)
        for at, line in said
        if line.startswith("towers: worker 0 of 2 is waiting for the others to start")
    ]
    # Within seconds of the wait (after TensorFlow's import), then again.
    assert len(notices) >= 2, "".join(line for _, line in said)[-3000:]
    assert notices[0][0] < 15 and notices[-1][0] - notices[0][0] >= 10
    for _, line in notices:
        assert f"worker 1 ({addresses[1]}) accepts connections but no " in line
        assert "gives up at 20 s, startup_timeout_seconds" in line
    assert workers[0].returncode != 0
    gave_up = said[-1][1]
    assert "WorkerLostError: worker 0 of 2: the workers did not all start within " in (
        gave_up
    )
    assert f"worker 1 ({addresses[1]}" in gave_up
    assert said[-1][0] < 60

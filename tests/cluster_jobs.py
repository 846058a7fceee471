"""Running tests/scripts/cluster_train.py as real worker processes on loopback,
and reading what they wrote: shared by the cluster job and cluster fault tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers.cluster.launch import free_ports, tf_configs

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


def reference(out, *args, towers=4):
    """One process with four towers (or ``towers``) on the whole batches."""
    out.mkdir()
    done = run(
        [sys.executable, SCRIPT, "--out", str(out), "--towers", str(towers), *args]
    )
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


def start_launch(out, *args, workers=2):
    """``towers launch`` of the job, running: the launcher's process, its
    output (the workers' prefixed lines) on stdout."""
    out.mkdir(exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable, "-m", "towers.cli", "launch", "--workers", str(workers),
            "--towers-per-worker", "2", "--",
            sys.executable, SCRIPT, "--out", str(out), *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip


def processes_of(out):
    """The pids of the live processes running the job's script for ``out``:
    its workers (not their launcher)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        zombie = "State:\tZ" in status
        worker = command[1:2] == [SCRIPT.encode()]  # python SCRIPT --out OUT ...
        if worker and str(out).encode() in command and not zombie:
            pids.append(int(entry.name))
    return pids


def weights(out, rank, name="weights"):
    with np.load(out / f"{name}-{rank}.npz") as saved:
        return [saved[key] for key in sorted(saved, key=lambda k: int(k[4:]))]


def result(out, rank):
    return json.loads((out / f"result-{rank}.json").read_text())


def steps_saved(path):
    """How many steps the checkpoint at ``path`` (its prefix or .index) holds."""
    prefix = str(path).removesuffix(".index")
    return int(tf.train.load_variable(prefix, "steps_done/.ATTRIBUTES/VARIABLE_VALUE"))


def assert_same_as(reference_out, out):
    for mine, theirs in zip(weights(out, 0), weights(reference_out, 0)):
        np.testing.assert_allclose(
            mine, theirs, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )
    # Every worker holds the same variables, to the bit.
    for w0, w1 in zip(weights(out, 0), weights(out, 1)):
        np.testing.assert_array_equal(w0, w1)


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


def listening_ports():
    """{port: listening address (hex, as in /proc/net/tcp)} of every TCP socket
    that listens in this process' network namespace."""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":  # LISTEN
                    address, port = local.rsplit(":", 1)
                    ports[int(port, 16)] = address
    return ports


def assert_a_relaunch_resumes(reference_out, out, *args):
    """``towers launch`` of the job again ends with the reference's weights and
    step count: no step lost or repeated."""
    job = launch(out, *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(reference_out, out)
    for rank in (0, 1):
        assert result(out, rank)["steps"] == result(reference_out, 0)["steps"] == 14


def launch_servers(network, code, *args):
    """``towers launch --network NETWORK`` of two ``python -c CODE`` workers, each
    printing "serving PORT NAMESPACE"; returns the job and {port: namespace}
    once both have."""
    job = subprocess.Popen(
        [sys.executable, "-m", "towers.cli", "launch", "--workers", "2",
         "--network", network, "--", sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    served = {}
    for line in job.stdout:
        words = line.split()
        if words[2:3] == ["serving"]:
            served[int(words[3])] = words[4]
        if len(served) == 2:
            break
    return job, served

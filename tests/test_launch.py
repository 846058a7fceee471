"""towers launch: real worker processes on loopback, prefixed output, fail fast."""

import json
import subprocess
import sys

import pytest

from towers.launch import free_ports, tf_configs

REPORT = (
    "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    "print(c['task']['index'], ','.join(c['cluster']['worker']), "
    "os.environ.get('TOWERS_PER_WORKER'))"
)


def launch(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "towers.cli", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_each_worker_gets_the_cluster_and_its_index():
    done = launch(
        "--workers", "3", "--towers-per-worker", "2", "--", sys.executable, "-c", REPORT
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert [line.split()[:2] for line in lines] == [
        ["[worker", "0]"],
        ["[worker", "1]"],
        ["[worker", "2]"],
    ]
    indices = [int(line.split()[2]) for line in lines]
    clusters = {line.split()[3] for line in lines}
    assert indices == [0, 1, 2] and len(clusters) == 1
    addresses = clusters.pop().split(",")
    assert len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert {line.split()[4] for line in lines} == {"2"}


def test_a_failed_worker_stops_the_others_and_sets_the_status():
    script = (
        "import json, os, sys, time; "
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
        "print('up', flush=True); "
        "sys.exit(7) if i == 1 else time.sleep(600)"
    )
    # The sleeper would outlive the 60 s timeout; the launcher must stop it.
    done = launch("--workers", "2", "--", sys.executable, "-c", script)
    assert done.returncode == 7
    assert "[worker 0] up" in done.stdout and "[worker 1] up" in done.stdout


def test_free_ports_are_distinct_and_configs_name_them():
    ports = free_ports(4)
    assert len(set(ports)) == 4
    configs = [json.loads(c) for c in tf_configs([f"127.0.0.1:{p}" for p in ports])]
    assert [c["task"]["index"] for c in configs] == [0, 1, 2, 3]
    assert all(c["cluster"]["worker"][2] == f"127.0.0.1:{ports[2]}" for c in configs)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--workers", "2"], "launch needs a command after --; received none"),
        (["--workers", "0", "--", "true"], "must be a positive integer; received 0"),
    ],
)
def test_launch_refuses_bad_input(args, expected):
    done = launch(*args)
    assert done.returncode == 2
    assert expected in done.stderr

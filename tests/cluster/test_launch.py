"""towers launch: real worker processes on loopback, prefixed output, fail fast."""

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.cluster_jobs import launch_servers, listening_ports
from towers.cluster import netns
from towers.cluster.launch import free_ports, tf_configs
from towers.cluster.launch import launch as towers_launch

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


def test_workers_join_the_private_network_after_the_first_has_ended():
    # The first worker creates the namespace; one that ends at once (true)
    # must not take it with it before the others join: the launcher holds it.
    done = launch("--workers", "3", "--", "true")
    assert done.returncode == 0, done.stderr[-2000:]


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


def test_a_failed_worker_stops_the_others_and_sets_the_status(tmp_path):
    # Worker 1 fails once worker 0 is up (a file it leaves): on a busy machine
    # worker 0 could otherwise be stopped before it printed.
    marker = str(tmp_path / "up")
    script = (
        "import json, os, sys, time; "
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
        "print('up', flush=True); "
        f"open({marker!r}, 'w').close() if i == 0 else None; "
        f"[time.sleep(0.05) for _ in range(600) if not os.path.exists({marker!r})]; "
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
        (
            ["--workers", "1", "--grace", "0", "--", "true"],
            "must be a positive number; received 0",
        ),
    ],
)
def test_launch_refuses_bad_input(args, expected):
    done = launch(*args)
    assert done.returncode == 2
    assert expected in done.stderr


def test_launch_refuses_a_grace_that_is_not_a_positive_number():
    with pytest.raises(
        ValueError, match="--grace must be a positive number; received -1"
    ):
        towers_launch(["true"], 1, grace=-1)


# Ignores SIGTERM: only the launcher's SIGKILL after the grace period stops it.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(600)"
)


def test_workers_still_running_after_the_grace_period_are_killed():
    job = subprocess.Popen(
        [sys.executable, "-m", "towers.cli", "launch", "--workers", "2",
         "--grace", "2", "--", sys.executable, "-c", STUBBORN],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(2):
            assert job.stdout.readline().endswith("up\n")
        job.send_signal(signal.SIGTERM)
        _, said = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGKILL
    for worker in (0, 1):
        assert f"worker {worker} did not stop within 2 s (--grace) of SIGTERM" in said


# Each worker listens on every interface of its port, as TensorFlow's servers
# do, reaches its peer on loopback, and prints its network namespace and port.
LISTEN_ON_ALL = (
    "import json, os, socket, time; c = json.loads(os.environ['TF_CONFIG']); "
    "i = c['task']['index']; ports = [int(a.split(':')[1]) for a in "
    "c['cluster']['worker']]; s = socket.socket(); s.bind(('0.0.0.0', ports[i])); "
    "s.listen(); print('serving', ports[i], os.readlink('/proc/self/ns/net'), "
    "flush=True); time.sleep(1); "
    "socket.create_connection(('127.0.0.1', ports[1 - i]), timeout=5).close(); "
    "print('reached', ports[1 - i], flush=True); time.sleep(float(sys.argv[1]))"
)


@pytest.mark.parametrize("network", ["private", "host"])
def test_workers_on_a_private_network_are_out_of_reach_of_the_machine(network):
    job, served = launch_servers(network, "import sys; " + LISTEN_ON_ALL, "3")
    seen_here = set(listening_ports())
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert out.count("reached") == 2  # the workers reach each other
    mine = os.readlink("/proc/self/ns/net")
    if network == "private":
        # One namespace for the job, not the machine's: a socket bound to every
        # interface there is on no interface of the machine.
        assert len(set(served.values())) == 1 and mine not in served.values()
        assert not set(served) & seen_here
    else:
        assert set(served.values()) == {mine} and set(served) <= seen_here


def test_where_no_private_network_can_be_made_the_launcher_says_so(monkeypatch, capsys):
    def refused(uid, gid):
        raise PermissionError(1, "unshare: Operation not permitted")

    monkeypatch.setattr(netns, "create", refused)
    out = io.StringIO()
    where = "import os; print(os.readlink('/proc/self/ns/net'))"
    status = towers_launch([sys.executable, "-c", where], 2, out=out)
    assert status == 0
    assert "refuses a private network namespace" in capsys.readouterr().err
    # The job ran, on the machine's network.
    spaces = {line.split()[2] for line in out.getvalue().splitlines()}
    assert spaces == {os.readlink("/proc/self/ns/net")}

"""A worker that stops answering is named (towers/cluster/faults.py), in this
process."""

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tensorflow as tf

from towers.cluster import faults
from towers.cluster.cluster import Cluster
from towers.cluster.faults import (
    WorkerLostError,
    lost_error,
    raise_if_lost,
    unreachable,
)


def grpc_server():
    """A real gRPC server on a free loopback port: it answers handshakes."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_unreachable_names_peers_that_refuse_connections():
    server, alive = grpc_server()
    try:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
            dead = f"127.0.0.1:{closed.getsockname()[1]}"
            cluster = Cluster(["127.0.0.1:1", alive, dead], index=0)
            lost = unreachable(cluster, timeout=1.0)
            error = lost_error(cluster, RuntimeError("Collective has timed out."), 10)
    finally:
        server.stop(None)
    assert [(p.rank, p.address, p.dead) for p in lost] == [(2, dead, True)]
    assert f"cannot reach worker 2 ({dead}" in str(error)
    assert "Received: Collective has timed out." in str(error)


def test_a_peer_that_accepts_but_never_answers_is_named_as_stopped():
    # A SIGSTOPped process's kernel still accepts connections; its server is
    # silent. A socket that listens and never reads is the same to a peer.
    server, live = grpc_server()
    try:
        with socket.socket() as mute:
            mute.bind(("127.0.0.1", 0))
            mute.listen()
            quiet = f"127.0.0.1:{mute.getsockname()[1]}"
            cluster = Cluster(["127.0.0.1:1", live, quiet], index=0)
            started = time.monotonic()
            error = lost_error(cluster, RuntimeError("Collective timed out"), 5.0)
            probed = time.monotonic() - started
    finally:
        server.stop(None)
    message = str(error)
    assert f"no answer from worker 2 ({quiet}: accepts connections but its " in (
        message
    )
    assert "it is stopped (SIGSTOP, a debugger)" in message
    assert "worker 1" not in message and "cannot reach" not in message
    assert probed < 5  # the probe's 2 s, not a hang


def test_every_peer_answering_says_one_is_slow_or_stuck():
    server, live = grpc_server()
    try:
        cluster = Cluster(["127.0.0.1:1", live], 0)
        error = lost_error(cluster, RuntimeError("line one\nCollective timed out"), 2)
    finally:
        server.stop(None)
    assert "every worker's server still answers, so one is slow or stuck" in str(error)
    # The cause is the line of TensorFlow's message that says what happened.
    assert "Received: Collective timed out." in str(error)


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.DeadlineExceededError(None, None, "deadline"),
        tf.errors.UnavailableError(None, None, "socket closed"),
        tf.errors.InvalidArgumentError(None, None, "Collective has timed out"),
        # Seen under load with a stopped peer: the group aborted earlier, and
        # the error takes the kind of that first failure.
        tf.errors.InternalError(
            None,
            None,
            "Collective ops is aborted by: failed to connect to all addresses\n"
            "The error could be from a previous operation. Restart your program "
            "to reset.",
        ),
    ],
)
def test_a_missing_peer_becomes_worker_lost_error(error):
    cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=1)
    with pytest.raises(WorkerLostError, match="worker 1 of 2: a collective") as raised:
        raise_if_lost(cluster, error, 1.0)
    assert raised.value.__cause__ is error


def test_other_errors_are_left_alone():
    cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=0)
    raise_if_lost(cluster, tf.errors.InvalidArgumentError(None, None, "shape"), 0.1)


def test_a_step_past_its_timeout_aborts_its_collectives_when_a_peer_is_silent(
    monkeypatch,
):
    """The probe, not TensorFlow's own collective timeout, ends a step that
    waits for a stopped peer (issue 35: that timeout crashed the process)."""
    aborted = []
    monkeypatch.setattr(faults._runtime, "abort_collectives", aborted.append)
    server, live = grpc_server()
    try:
        with socket.socket() as mute:
            mute.bind(("127.0.0.1", 0))
            mute.listen()
            quiet = f"127.0.0.1:{mute.getsockname()[1]}"
            cluster = Cluster(
                ["127.0.0.1:1", live, quiet], index=0, timeout_seconds=0.5
            )
            watch = faults.LostWorkerWatch(cluster, every=0.2)
            with watch.step():
                time.sleep(0.3)  # a step that ends in time: nothing probed
            time.sleep(0.6)  # between steps: nothing probed either
            assert aborted == []
            with watch.step():
                deadline = time.monotonic() + 10
                while not aborted and time.monotonic() < deadline:
                    time.sleep(0.1)  # a step stuck in its collectives
    finally:
        server.stop(None)
    assert aborted == ["towers: worker(s) 2 stopped answering after 0.5 s "
                       "(timeout_seconds)"]  # fmt: skip


def test_a_slow_step_whose_peers_answer_is_not_aborted(monkeypatch):
    aborted = []
    monkeypatch.setattr(faults._runtime, "abort_collectives", aborted.append)
    server, live = grpc_server()
    try:
        cluster = Cluster(["127.0.0.1:1", live], index=0, timeout_seconds=0.3)
        with faults.LostWorkerWatch(cluster, every=0.2).step():
            time.sleep(1.5)  # past its timeout, probed several times
    finally:
        server.stop(None)
    assert aborted == []

"""A worker that stops answering is named (towers/faults.py), in this process."""

import socket

import pytest
import tensorflow as tf

from towers.cluster import Cluster
from towers.faults import WorkerLostError, lost_error, raise_if_lost, unreachable


def test_unreachable_names_peers_that_refuse_connections():
    with socket.socket() as alive, socket.socket() as dead:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        dead.bind(("127.0.0.1", 0))  # bound, not listening: refuses
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in (alive, dead)]
        cluster = Cluster(["127.0.0.1:1", *addresses], index=0)
        lost = unreachable(cluster, timeout=1.0)
        error = lost_error(cluster, RuntimeError("Collective has timed out."), 10.0)
    assert [(rank, address) for rank, address, _ in lost] == [(2, addresses[1])]
    assert f"cannot reach worker 2 ({addresses[1]}" in str(error)
    assert "Received: Collective has timed out." in str(error)


def test_every_peer_alive_says_one_is_slow_or_stuck():
    with socket.socket() as alive:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        cluster = Cluster(["127.0.0.1:1", f"127.0.0.1:{alive.getsockname()[1]}"], 0)
        error = lost_error(cluster, RuntimeError("line one\nCollective timed out"), 2)
    assert "every worker still accepts connections, so one is slow or stuck" in str(
        error
    )
    # The cause is the line of TensorFlow's message that says what happened.
    assert "Received: Collective timed out." in str(error)


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.DeadlineExceededError(None, None, "deadline"),
        tf.errors.UnavailableError(None, None, "socket closed"),
        tf.errors.InvalidArgumentError(None, None, "Collective has timed out"),
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

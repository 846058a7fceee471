"""A worker that stops answering: named, not waited on forever.

Every collective across workers carries a timeout (``Cluster.timeout_seconds``).
When one fails for want of a peer, the survivors raise :class:`WorkerLostError`
naming the workers that no longer accept connections (dead) or saying that all
still do (slow or stuck). TensorFlow's collective runtime cannot continue in
that process: every worker restarts, and ``fit`` resumes from its checkpoint.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

import tensorflow as tf

from towers.cluster import Cluster
from towers.tf_config import split_address

# Words of the line in TensorFlow's error that says why a collective failed.
_CAUSES = ("timed out", "aborted by", "Socket closed", "failed to connect")
# The errors a collective raises when a peer does not come.
_LOST_KINDS = (
    tf.errors.DeadlineExceededError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)


class WorkerLostError(RuntimeError):
    """A peer worker did not take part in a collective within the timeout.

    The message names the workers that cannot be reached. TensorFlow's collective
    runtime cannot continue after this in the same process: restart every worker
    (``fit`` resumes from the last checkpoint).

    Example:
      >>> import socket
      >>> with socket.socket() as free:
      ...     free.bind(("127.0.0.1", 0))
      ...     port = free.getsockname()[1]  # closed again: nobody listens there
      >>> cluster = Cluster(["127.0.0.1:1", f"127.0.0.1:{port}"], index=0)
      >>> error = lost_error(cluster, RuntimeError("Collective ops is aborted"), 5.0)
      >>> isinstance(error, WorkerLostError), "cannot reach worker 1" in str(error)
      (True, True)
    """


class Unreachable(NamedTuple):
    """A peer that did not accept a connection."""

    rank: int
    address: str
    reason: str


def unreachable(cluster: Cluster, timeout: float = 2.0) -> list[Unreachable]:
    """The peers of this worker that do not accept a connection.

    Example:
      >>> import socket
      >>> with socket.socket() as listening:
      ...     listening.bind(("127.0.0.1", 0))
      ...     listening.listen()
      ...     alive = f"127.0.0.1:{listening.getsockname()[1]}"
      ...     unreachable(Cluster(["127.0.0.1:1", alive], index=0))
      []
    """
    lost = []
    for rank, address in enumerate(cluster.workers):
        if rank == cluster.index:
            continue
        host, port = split_address(address)
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError as error:
            lost.append(Unreachable(rank, address, error.strerror or str(error)))
    return lost


def lost_error(cluster: Cluster, error: Exception, waited: float) -> WorkerLostError:
    """The error a survivor raises when a collective failed or timed out.

    Example:
      >>> cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=1)
      >>> error = lost_error(cluster, RuntimeError("Collective ops is aborted"), 3)
      >>> for part in str(error).split("; ")[:2]:
      ...     print(part)
      worker 1 of 2: a collective did not complete (waited 3.0 s)
      cannot reach worker 0 (127.0.0.1:1: Connection refused)
    """
    lost = unreachable(cluster)
    if lost:
        who = ", ".join(f"worker {p.rank} ({p.address}: {p.reason})" for p in lost)
        what = f"cannot reach {who}; it has probably died"
    else:
        what = (
            "every worker still accepts connections, so one is slow or stuck "
            "(raise timeout_seconds if a step can legitimately take longer)"
        )
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    # TensorFlow's message starts with "Graph execution error:" and a
    # traceback; the cause is the line that says what happened.
    first_line = next(
        (ln for ln in lines if any(k in ln for k in _CAUSES)),
        lines[-1] if lines else "",
    )
    return WorkerLostError(
        f"worker {cluster.index} of {cluster.num_workers}: a collective did not "
        f"complete (waited {waited:.1f} s); {what}. Received: {first_line}. "
        "The job cannot continue; restart every worker (fit resumes from the "
        "last checkpoint)."
    )


def raise_if_lost(cluster: Cluster, error: Exception, waited: float) -> None:
    """Turns a collective that failed for want of a peer into WorkerLostError.

    Example:
      >>> cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=0)
      >>> raise_if_lost(cluster, ValueError("a bad shape"), 0.1)  # not a lost peer
      >>> raise_if_lost(cluster, tf.errors.DeadlineExceededError(None, None,
      ...               "Collective has timed out"), 60.0)
      Traceback (most recent call last):
      towers.faults.WorkerLostError: worker 0 of 2: a collective did not complete...
    """
    if isinstance(error, _LOST_KINDS) or "timed out" in str(error):
        raise lost_error(cluster, error, waited) from error

"""A worker that stops answering: named, not waited on forever.

A step that has run ``Cluster.timeout_seconds`` probes the other workers every
second (:class:`LostWorkerWatch`); when one no longer answers, this worker
aborts its collectives, as MultiWorkerMirroredStrategy's health check does.
Each collective also carries a timeout of its own, twice as long: the
backstop for a peer that answers but never joins (TensorFlow 2.21's own
timeout crashed the process about one time in five on a busy machine; issue
35). When a collective fails for want of a peer, the survivors raise
:class:`WorkerLostError`
naming the workers that no longer accept connections (dead), those that accept
them but whose gRPC server does not answer (stopped, e.g. SIGSTOP, or hung), or
saying that every one answers (slow). TensorFlow's collective runtime cannot
continue in that process: every worker restarts, and ``fit`` resumes from its
checkpoint.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple, TextIO

# TensorFlow's own dependency; its servers speak gRPC, so a gRPC handshake is the
# one probe that tells a live server from a stopped process (whose kernel still
# accepts connections).
import grpc
import tensorflow as tf

from towers import _runtime
from towers.cluster.cluster import Cluster
from towers.cluster.tf_config import split_address

# Words of the line in TensorFlow's error that says why a collective failed.
_CAUSES = ("timed out", "aborted by", "Socket closed", "failed to connect")
_STOPPED = "it is stopped (SIGSTOP, a debugger) or its machine is overloaded"
# While the workers wait for each other to start: the first notice after this
# many seconds, then one every NOTICE_EVERY_SECONDS.
NOTICE_FIRST_SECONDS = 3.0
NOTICE_EVERY_SECONDS = 15.0
# A collective whose group was aborted by an earlier failure (a peer that timed
# out); TensorFlow raises it with the kind of that failure, which may be any.
_ABORTED = "Collective ops is aborted by"
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
    """A peer that did not accept a connection, or whose server did not answer."""

    rank: int
    address: str
    reason: str
    dead: bool = True  # refused the connection; False: accepted, never answered


def unreachable(cluster: Cluster, timeout: float = 2.0) -> list[Unreachable]:
    """The peers of this worker that do not accept a connection, then those that
    accept one but whose gRPC server does not answer within ``timeout`` seconds.

    Example:
      >>> with socket.socket() as closed:
      ...     closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
      ...     dead = f"127.0.0.1:{closed.getsockname()[1]}"
      ...     [(p.rank, p.dead) for p in unreachable(Cluster(["a:1", dead], 0))]
      [(1, True)]
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
    accepting = [a for r, a in enumerate(cluster.workers) if r != cluster.index]
    accepting = [a for a in accepting if a not in {p.address for p in lost}]
    silent = set(silent_servers(accepting, timeout))
    for rank, address in enumerate(cluster.workers):
        if address in silent:
            why = f"accepts connections but its server did not answer in {timeout} s"
            lost.append(Unreachable(rank, address, why, dead=False))
    return lost


def silent_servers(addresses: list[str], timeout: float) -> list[str]:
    """Those of ``addresses`` whose gRPC server does not complete a handshake
    within ``timeout`` seconds, probed at once.

    Example:
      >>> from concurrent.futures import ThreadPoolExecutor
      >>> server = grpc.server(ThreadPoolExecutor(1))  # answers handshakes
      >>> live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
      >>> server.start()
      >>> with socket.socket() as mute:  # listens, never answers
      ...     mute.bind(("127.0.0.1", 0))
      ...     mute.listen()
      ...     quiet = f"127.0.0.1:{mute.getsockname()[1]}"
      ...     silent_servers([live, quiet], timeout=1.0) == [quiet]
      True
      >>> _ = server.stop(None)
    """
    channels = [grpc.insecure_channel(address) for address in addresses]
    deadline = time.monotonic() + timeout
    silent = []
    try:
        for address, channel in zip(addresses, channels):
            try:
                grpc.channel_ready_future(channel).result(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except grpc.FutureTimeoutError:
                silent.append(address)
    finally:
        for channel in channels:
            channel.close()
    return silent


@contextlib.contextmanager
def waiting_notices(
    cluster: Cluster,
    first: float = NOTICE_FIRST_SECONDS,
    every: float = NOTICE_EVERY_SECONDS,
    out: TextIO | None = None,
) -> Iterator[None]:
    """Within, while the workers wait for each other to start (the first
    collectives), says ``first`` seconds in and then every ``every`` seconds
    which peers this worker is waiting for, on ``out`` (default stderr)."""
    done = threading.Event()
    started = time.monotonic()

    def notice() -> None:
        wait = first
        while not done.wait(wait):
            said = waiting_message(cluster, time.monotonic() - started)
            if not done.is_set():
                print(said, file=out or sys.stderr, flush=True)
            wait = every

    threading.Thread(target=notice, name="towers-startup-notices", daemon=True).start()
    try:
        yield
    finally:
        done.set()


class LostWorkerWatch:
    """Aborts a step that has run ``cluster.timeout_seconds`` once a peer is
    lost: one thread per worker, started with the first step, looks every
    ``every`` seconds; past the timeout it probes the other workers
    (:func:`unreachable`), and when one is lost it aborts this worker's
    pending collectives, so the step raises at once (``raise_if_lost`` names
    the worker). A step that ends in time is never probed; a slow step whose
    peers all answer goes on. A step costs two attribute writes."""

    def __init__(self, cluster: Cluster, every: float = 1.0):
        self.cluster, self.every = cluster, every
        self._since: float | None = None  # when the running step started
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Within: one step, watched."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="towers-lost-workers", daemon=True
            )
            self._thread.start()
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.every)
            since = self._since
            if since is None or time.monotonic() - since < self.cluster.timeout_seconds:
                continue
            lost = unreachable(self.cluster)
            if lost and self._since == since:  # the same step, still running
                ranks = ", ".join(str(p.rank) for p in lost)
                _runtime.abort_collectives(
                    f"towers: worker(s) {ranks} stopped answering after "
                    f"{self.cluster.timeout_seconds:g} s (timeout_seconds)"
                )
                return


def waiting_message(cluster: Cluster, waited: float) -> str:
    """What a worker waiting for its peers to start says: who it waits for.

    Example:
      >>> with socket.socket() as closed:
      ...     closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
      ...     peer = f"127.0.0.1:{closed.getsockname()[1]}"
      ...     cluster = Cluster(["a:1", peer], 0, startup_timeout_seconds=60)
      ...     said = waiting_message(cluster, 3)
      >>> print(said.replace(peer, "PEER"))  # doctest: +NORMALIZE_WHITESPACE
      towers: worker 0 of 2 is waiting for the others to start (3 s so far, gives
      up at 60 s, startup_timeout_seconds): worker 1 (PEER: Connection refused)
      does not accept connections yet
    """
    lost = unreachable(cluster, timeout=1.0)
    said = [
        f"worker {p.rank} ({p.address}: {p.reason}) does not accept connections yet"
        if p.dead
        else f"worker {p.rank} ({p.address}) accepts connections but no TensorFlow "
        "server answers there (another process on its port, or a stopped worker)"
        for p in lost
    ]
    who = "; ".join(said) or (
        "every worker's server answers; waiting for them to reach the first "
        "collective (still building the model?)"
    )
    return (
        f"towers: worker {cluster.index} of {cluster.num_workers} is waiting for the "
        f"others to start ({waited:.0f} s so far, gives up at "
        f"{cluster.startup_timeout_seconds:g} s, startup_timeout_seconds): {who}"
    )


def lost_error(
    cluster: Cluster, error: Exception, waited: float, startup: bool = False
) -> WorkerLostError:
    """The error a survivor raises when a collective failed or timed out
    (``startup``: one of the first, while the workers wait for each other).

    Example:
      >>> cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=1)
      >>> error = lost_error(cluster, RuntimeError("Collective ops is aborted"), 3)
      >>> for part in str(error).split("; ")[:2]:
      ...     print(part)
      worker 1 of 2: a collective did not complete (waited 3.0 s)
      cannot reach worker 0 (127.0.0.1:1: Connection refused)
    """
    lost = unreachable(cluster)
    said = []
    died = "it has not started, or has exited" if startup else "it has probably died"
    for dead, verdict in ((True, died), (False, _STOPPED)):
        who = [f"worker {p.rank} ({p.address}: {p.reason})" for p in lost]
        who = [w for w, p in zip(who, lost) if p.dead == dead]
        if who:
            verb = "cannot reach" if dead else "no answer from"
            said.append(f"{verb} {', '.join(who)}; {verdict}")
    what = "; ".join(said) or (
        "every worker's server still answers, so one is slow or stuck in its own "
        "code (raise timeout_seconds if a step can legitimately take longer)"
    )
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    # TensorFlow's message starts with "Graph execution error:" and a
    # traceback; the cause is the line that says what happened.
    first_line = next(
        (ln for ln in lines if any(k in ln for k in _CAUSES)),
        lines[-1] if lines else "",
    ).rstrip(".")
    if startup:
        return WorkerLostError(
            f"worker {cluster.index} of {cluster.num_workers}: the workers did not "
            f"all start within {cluster.startup_timeout_seconds:g} s "
            f"(startup_timeout_seconds; waited {waited:.1f} s); {what}. Received: "
            f"{first_line}. Start every worker of TF_CONFIG's cluster, or give them "
            "longer (Cluster(startup_timeout_seconds=...) or $TOWERS_STARTUP_TIMEOUT)."
        )
    return WorkerLostError(
        f"worker {cluster.index} of {cluster.num_workers}: a collective did not "
        f"complete (waited {waited:.1f} s); {what}. Received: {first_line}. "
        "The job cannot continue; restart every worker (fit resumes from the "
        "last checkpoint)."
    )


def raise_if_lost(
    cluster: Cluster, error: Exception, waited: float, startup: bool = False
) -> None:
    """Turns a collective that failed for want of a peer into WorkerLostError.

    Example:
      >>> cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=0)
      >>> raise_if_lost(cluster, ValueError("a bad shape"), 0.1)  # not a lost peer
      >>> raise_if_lost(cluster, tf.errors.DeadlineExceededError(None, None,
      ...               "Collective has timed out"), 60.0)
      Traceback (most recent call last):
      towers.cluster.faults.WorkerLostError: worker 0 of 2: a collective did not ...
    """
    said = str(error)
    if isinstance(error, _LOST_KINDS) or "timed out" in said or _ABORTED in said:
        raise lost_error(cluster, error, waited, startup) from error

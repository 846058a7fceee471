"""``towers launch``: N local worker processes, each with its own ``TF_CONFIG``.

Each worker gets the cluster (every worker's ``host:port``, ports free on the host
when chosen) and its own index, exactly as a multi-machine job would give them,
so one script runs unchanged on one box or many. Every line a worker prints is
prefixed with ``[worker i]``. When any worker fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits with the
failed worker's status: a multi-worker job that lost a worker cannot go on.

A scheduler stops the job by signalling the launcher. SIGTERM or SIGINT (Ctrl-C)
is passed on to every worker as SIGTERM, so they take fit's preemption path
(``towers/training/preemption.py``: all stop after the same step, the chief saves, each
exits with 75); the launcher waits for them up to ``grace`` seconds, kills what is
left, and exits with their status. A second signal kills them at once. If the
launcher itself is killed (SIGKILL), its workers do not train on: each is asked
to stop as if preempted, by the kernel (``PR_SET_PDEATHSIG``) and by a watchdog
in the worker (``towers/cluster/orphan.py``), which also sends its output, which no one
reads any more, to ``/dev/null``.

TensorFlow's servers listen on every interface of their ports, so by default the
workers run in a private network namespace (``towers/cluster/netns.py``) where the only
interface is their own loopback: nothing off this machine's job can reach them.
Where the kernel refuses one, the launcher says so and uses the machine's network.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from towers.cluster import netns, orphan
from towers.cluster.orphan import PREEMPTED_EXIT_CODE

LOOPBACK = "127.0.0.1"
NETWORKS = ("private", "host")
# Environment variable telling a worker how many local towers to run.
TOWERS_PER_WORKER_ENV = "TOWERS_PER_WORKER"
# How long the workers have to stop after a SIGTERM: the step under way, and the
# chief's save when preempted.
GRACE_SECONDS = 60.0
# How long the others have to stop when one worker failed (none is saving).
_STOP_SECONDS = 5.0


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports nothing listens on at ``host`` right now.

    The sockets are held until all are chosen, so the ports differ; another
    process may still take one before a worker binds it (TensorFlow then fails
    with the port in its message).
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_configs(addresses: Sequence[str]) -> list[str]:
    """The ``TF_CONFIG`` of each worker of a cluster of ``addresses``.

    Example:
      >>> json.loads(tf_configs(["127.0.0.1:1000", "127.0.0.1:1001"])[1])["task"]
      {'type': 'worker', 'index': 1}
    """
    cluster = {"worker": list(addresses)}
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(len(addresses))
    ]


def launch(
    command: Sequence[str],
    workers: int,
    towers_per_worker: int | None = None,
    host: str = LOOPBACK,
    out: TextIO = sys.stdout,
    network: str = "private",
    grace: float = GRACE_SECONDS,
) -> int:
    """Runs ``command`` as ``workers`` processes; returns the job's exit status.

    Args:
      command: the program and its arguments, e.g. ``["python", "train.py"]``.
      workers: how many worker processes, at least 1.
      towers_per_worker: exported as ``TOWERS_PER_WORKER`` when given.
      host: the address the workers advertise to each other (loopback unless
        told otherwise; TensorFlow's servers listen on every interface).
      out: where the prefixed lines go.
      network: "private" (the workers share a network namespace of their own,
        whose only interface is its loopback; needs ``host`` on loopback) or
        "host" (the machine's network: their ports are open to it).
      grace: seconds the workers have to stop after the launcher passes a
        SIGTERM or SIGINT on (or after one exits preempted), before SIGKILL.

    Returns:
      0 when every worker succeeded, else the first failed worker's status (a
      worker killed by a signal counts as 128 + the signal number); after a
      SIGTERM or SIGINT, the workers' (75 when they stopped preempted).

    Raises:
      ValueError: no command, ``workers`` < 1, a ``network`` it cannot use, or
        a ``grace`` that is not a positive number.
    """
    if not command:
        raise ValueError(
            "launch needs a command after --; received none (e.g. "
            "towers launch --workers 2 -- python train.py)"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be a positive integer; received {workers!r}")
    if network not in NETWORKS:
        raise ValueError(f"--network must be one of {NETWORKS}; received {network!r}")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace <= 0:
        raise ValueError(f"--grace must be a positive number; received {grace!r}")
    if network == "private" and host != LOOPBACK:
        raise ValueError(
            f"--host {host} is not on a private network's loopback; pass --network "
            f"host to use it (received --host {host} with --network private)"
        )
    addresses = [f"{host}:{port}" for port in free_ports(workers, host)]
    held = netns.hold_private_network() if network == "private" else None
    if network == "private" and held is None:  # the kernel refused it
        print(_NO_PRIVATE_NETWORK, file=sys.stderr, flush=True)
    processes: list[subprocess.Popen] = []
    signals = _Forward(processes, out)
    try:
        for config in tf_configs(addresses):
            env = dict(os.environ, TF_CONFIG=config, PYTHONUNBUFFERED="1")
            env[orphan.LAUNCHER_ENV] = str(os.getpid())
            if towers_per_worker is not None:
                env[TOWERS_PER_WORKER_ENV] = str(towers_per_worker)
            enter = None if held is None else netns.joining(held)
            processes.append(_start(command, env, enter))
    except BaseException:
        _stop(processes)
        signals.restore()
        raise
    finally:  # every worker is in the namespaces now, or none will be
        if held is not None:
            netns.release(held)
    lock = threading.Lock()
    readers = [
        threading.Thread(
            target=_prefix_lines, args=(process, f"[worker {index}] ", out, lock)
        )
        for index, process in enumerate(processes)
    ]
    for reader in readers:
        reader.start()
    try:
        status = _wait_for_job(processes, signals, grace)
    finally:
        _stop(processes)
        signals.restore()
        for reader in readers:
            reader.join()
    return status


class _Forward:
    """While the job runs, SIGTERM and SIGINT to the launcher go on to every
    worker's process group as SIGTERM (the preemption signal); a second one
    sends SIGKILL. Only from the main thread (Python's rule for handlers)."""

    def __init__(self, processes: list[subprocess.Popen], out: TextIO):
        self.processes, self.out = processes, out
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        live = [p for p in self.processes if p.poll() is None]
        name = signal.Signals(signum).name
        if self.received is not None:
            print(
                f"towers launch: {name} again; killing the workers (SIGKILL)",
                file=sys.stderr,
                flush=True,
            )
            for process in live:
                _signal_group(process, signal.SIGKILL)
            return
        self.received = signum
        print(
            f"towers launch: {name}; passing SIGTERM on to {len(live)} worker(s): "
            "they stop after the same step and the chief saves (a second signal "
            "kills them)",
            file=sys.stderr,
            flush=True,
        )
        for process in live:
            _signal_group(process, signal.SIGTERM)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


_NO_PRIVATE_NETWORK = (
    "towers launch: this machine refuses a private network namespace (user "
    "namespaces or unshare are not allowed here); the workers use the machine's "
    "network, where TensorFlow's servers listen on every interface of their "
    "ports. Pass --network host to say that is intended."
)


def _start(command: Sequence[str], env: dict, enter) -> subprocess.Popen:
    launcher = os.getpid()

    def prepare() -> None:  # in the child, between fork and exec
        if enter is not None:
            enter()
        # After entering the namespaces (a change of credentials clears it):
        # SIGTERM when the launcher dies, then make sure it had not already.
        orphan.die_with_parent(signal.SIGTERM)
        if os.getppid() != launcher:
            os._exit(1)

    return subprocess.Popen(
        list(command),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so stopping it stops its children too
        preexec_fn=prepare,
    )


def _prefix_lines(process, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in process.stdout:
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()


def _wait_for_job(
    processes: list[subprocess.Popen], signals: _Forward, grace: float
) -> int:
    """Waits until all succeed (0) or one fails (its status). After a signal
    passed on, or a worker that exits preempted (the others stop after the same
    step, and the chief is saving), waits for all of them instead, up to
    ``grace`` seconds."""
    while True:
        statuses = [p.poll() for p in processes]
        failed = [s for s in statuses if s not in (None, 0)]
        if signals.received is not None or PREEMPTED_EXIT_CODE in failed:
            return _wait_for_all(processes, signals, grace)
        if failed:
            return _exit_status(failed[0])
        if all(s == 0 for s in statuses):
            return 0
        time.sleep(0.05)


def _wait_for_all(
    processes: list[subprocess.Popen], signals: _Forward, grace: float
) -> int:
    """Every worker's end, SIGTERM and SIGKILL after ``grace`` seconds for the
    ones still running; the first worker's status that is not 0."""
    if signals.received is None:  # a worker was preempted: tell the others
        for process in processes:
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for index, process in enumerate(processes):
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"towers launch: worker {index} did not stop within {grace:g} s "
                "(--grace) of SIGTERM; killing it",
                file=sys.stderr,
                flush=True,
            )
            _signal_group(process, signal.SIGKILL)
            process.wait()
    failed = [p.returncode for p in processes if p.returncode != 0]
    return _exit_status(failed[0]) if failed else 0


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to every live worker's process group, SIGKILL after a grace."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_SECONDS
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass

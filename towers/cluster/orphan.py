"""A launched worker whose launcher is gone stops instead of training on.

``towers launch`` passes its signals on to its workers (``towers/cluster/launch.py``),
but a launcher killed outright (SIGKILL, the OOM killer) cannot. Then nothing
reads the workers' output, nothing stops them when one fails, and the next
launch would race them for the checkpoint directory. So each worker is asked to
stop as if preempted (SIGTERM: during ``fit`` all workers stop after the same
step and the chief saves, ``towers/training/preemption.py``), two ways:

- the kernel sends SIGTERM to the launcher's child when the launcher dies
  (``PR_SET_PDEATHSIG``, set by the launcher between fork and exec);
- a watchdog thread in the worker (started by ``Cluster.start``) checks the
  launcher five times a second, for a worker the launcher did not start itself
  (a command run through a shell).

Either way the worker's output goes to ``/dev/null`` first: its pipe's reader
is gone, and the next line it printed would fail with BrokenPipeError before the
chief could save.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

# EX_TEMPFAIL: a temporary failure, run the same command again. A worker that
# was preempted (or whose launcher died) exits with it; ``towers launch`` waits
# for the others to save when one does (``towers/cluster/launch.py``).
PREEMPTED_EXIT_CODE = 75

# Set by towers launch in each worker's environment: the launcher's pid.
LAUNCHER_ENV = "TOWERS_LAUNCHER_PID"
_POLL_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if _LINUX else None
_watching = threading.Lock()
_watched: list[int] = []
# The launcher's pid: whether it was this process' parent when first asked.
_was_parent: dict[int, bool] = {}


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send ``sig`` to this process when its parent dies (in
    a child between fork and exec; Linux only, elsewhere the watchdog alone)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def launcher() -> tuple[int, str | None] | None:
    """The launcher's pid and start time (from ``$TOWERS_LAUNCHER_PID``), or
    None when this process was not started by ``towers launch``."""
    value = os.environ.get(LAUNCHER_ENV, "")
    if not value.isdigit():
        return None
    pid = int(value)
    _was_parent.setdefault(pid, os.getppid() == pid)
    return pid, _start_time(pid)


def gone(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` (started at ``started``) has ended: no longer
    this process' parent if it was, a zombie, or no process; a new process
    that took its pid does not count as it.

    Example:
      >>> gone(os.getpid(), _start_time(os.getpid()))
      False
    """
    if _was_parent.get(pid) and os.getppid() != pid:
        return True  # reparented: the launcher has exited (maybe not yet reaped)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    if _state(pid) == "Z":
        return True
    return started is not None and _start_time(pid) != started


def silence() -> None:
    """Sends this process' stdout and stderr to ``/dev/null``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def silence_if_orphaned() -> None:
    """Within a SIGTERM handler: if the launcher is gone, silences this process
    before it prints again."""
    known = launcher()
    if known is not None and gone(*known):
        silence()


def watch() -> None:
    """Starts the watchdog (once per process; nothing without a launcher)."""
    known = launcher()
    with _watching:
        if known is None or _watched:
            return
        _watched.append(known[0])
    threading.Thread(
        target=_watch, args=known, name="towers-launcher-watchdog", daemon=True
    ).start()


def _watch(pid: int, started: str | None) -> None:
    while not gone(pid, started):
        time.sleep(_POLL_SECONDS)
    silence()
    os.kill(os.getpid(), signal.SIGTERM)


def _stat(pid: int) -> list[str]:
    """Fields 3 on of ``/proc/PID/stat`` (empty off Linux or when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The name (field 2) may hold spaces: count from its closing ")".
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def _start_time(pid: int) -> str | None:
    """The process' start time in clock ticks since boot, which tells it from a
    later process given the same pid; None off Linux."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


# Whether the launcher is this process' parent, noted at import (while it lives).
launcher()

"""Preemption: a scheduler's SIGTERM during ``fit``.

A scheduler that preempts a job sends SIGTERM and waits before it kills. During
``fit`` with a ``checkpoint_dir``, towers catches it: the step under way finishes,
a checkpoint is saved at that step, and the process exits with
``PREEMPTED_EXIT_CODE``; the relaunch resumes with no step lost or repeated.

In a cluster the notice may reach one worker, or each at a different moment.
The worker that got it raises a flag that rides in the next step's cross-worker
sum (``Workers.request_stop``), so every worker learns of it after the same step:
all stop there, the chief saves, and none is left waiting in a collective. This
is what tf.distribute's ``PreemptionCheckpointHandler`` promises, for
MultiWorkerMirroredStrategy only.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from towers.cluster import orphan
from towers.cluster.orphan import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption"]


class Preemption:
    """Watches for SIGTERM while ``fit`` runs (a context manager).

    Args:
      workers: the engine's link to the other workers, or None.
      enabled: whether to catch SIGTERM (there is a checkpoint to save); else the
        signal keeps its default action.
    """

    def __init__(self, workers: Any, enabled: bool):
        self.workers = workers
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.noticed = False
        self._asked = False
        self._previous = None

    def __enter__(self) -> Preemption:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._notice)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def _notice(self, signum: int, frame: Any) -> None:
        # Only a flag: the step under way finishes undisturbed. A launcher that
        # died reads no more output: printing to its pipe would fail.
        orphan.silence_if_orphaned()
        self.noticed = True

    def before_step(self) -> None:
        """In a cluster, passes a notice on to the next step's sum."""
        if self.noticed and self.workers is not None and not self._asked:
            self.workers.request_stop()
            self._asked = True

    def stop_now(self) -> bool:
        """Whether to stop after the step that just ran: this process was told
        to, or (in a cluster) any worker was, as the step's sum says."""
        if self.workers is None:
            return self.noticed
        stop = self.workers.last_stop
        return stop is not None and float(stop) > 0

    def exit(self, where: str, directory: str) -> None:
        """Says where the run stopped and exits with ``PREEMPTED_EXIT_CODE``."""
        print(
            f"towers: preempted (SIGTERM): stopped after {where}; the checkpoint "
            f"in {directory} resumes it. Exiting with status {PREEMPTED_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(PREEMPTED_EXIT_CODE)

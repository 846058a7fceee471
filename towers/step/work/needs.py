"""What a tower's work declares, before any trace, that the way the towers
run must serve (``run/runner.py``'s ``Runner.way`` reads nothing else).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Needs:
    """``actions``: run once for every tower (a model's own step's applies,
    assignments, metric updates); ``rows``: every tower's rows gathered (a
    coupled ``compute_loss``); ``sums``: sums over the towers (global batch
    statistics, a mixture of experts' terms); ``xla``: each pass one XLA
    computation."""

    actions: bool = False
    rows: bool = False
    sums: bool = False
    xla: bool = False


# A model's own step: it meets wherever it applies, assigns and updates.
OWN = Needs(actions=True)

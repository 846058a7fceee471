"""The current tower: one object per thread that traces a tower's work, as
tf.distribute's replica context, holding what the step's parts and the
patched Keras calls (``patches.py``) read of it. The package's one
``threading.local``: a tower's thread starts with a fresh one, handed the
step's context (``step``: what holds for the whole step) by the thread that
traces the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Seat(Protocol):
    """Where a tower meets the others (``step/run/seats.py``: a ``Seat`` in
    turns, a ``CutSeat`` in a pass traced to be cut, ``ALONE``): the verbs
    every meeting takes."""

    rank: int
    first: bool
    own: bool
    quiet: bool
    summing: bool
    weight: Any
    inputs: Any
    marks: dict
    forms: dict

    def total(self, value: Any, backward: bool = False) -> Any: ...
    def everyone(self, value: Any) -> list[Any]: ...
    def from_first(self, compute: Callable[[], Any]) -> Any: ...
    def once(self, value: Any, action: Callable[[list], Any], writes=None) -> Any: ...
    def form(self, value: Any) -> Any: ...


# A tower's rows of the batch (``step/rules/places.py``'s ``rows``): its
# static rows (None: unknown), its first row, the batch's rows, its rows of
# its data's other parts, and the rows the step is written for.
Rows = tuple[Any, Any, Any, tuple, Any]


@dataclasses.dataclass
class TracedStep:
    """What holds for the whole step traced, shared by its towers' threads
    (``step/rules/places.py``'s ``placing``; ``step/run/turns.py`` hands it on).

    Attributes:
      hook: a model's own step's (``train_step``...), "" for the built-in one.
      learned: what the engine's runner learned of its model's draws
        (``places.Learned``: its probe's readings, the draws named).
      batch_rows: the (global) batch's rows; ``worker_first``: a cluster
        worker's first row in it; ``unplaced``: a worker whose rows nothing
        placed (its model holds no seed generator).
      steady: the probe's trace, where a draw towers cannot place is its
        distribution's middle.
      python: the Python random state one device's trace starts from;
        ``python_end``: where the first tower's trace left it.
      warm_ups: the XLA warm-ups the trace queues (``step/run/warm_up.py``),
        None where nothing runs them.
    """

    hook: str = ""
    learned: Any = None  # rules/places.Learned, which imports this module
    batch_rows: Any = None
    worker_first: Any = 0
    unplaced: bool = False
    steady: bool = False
    python: Any = None
    python_end: Any = None
    warm_ups: list[Callable[[], None]] | None = None


IDLE = TracedStep()  # outside a step: read, never written


@dataclasses.dataclass(eq=False)  # a thread's own: compared by identity
class Tower:
    """This thread's tower.

    Attributes:
      seat: where it meets the other towers (None: alone).
      rows: its rows of the batch; ``python``: its Python ``random`` while
        it is traced; ``drawn``: its draws' row counts so far, in call order
        (``step/rules/places.py``).
      calling: the layers whose ``call`` it is within; ``skip``: the values
        its next counted draw skips (``patches.py``).
      moments: where BatchNormalization's moments go, by the
        ``MovingStatistics`` recording them (``step/rules/batchnorm.py``).
      trial: the probe's trial of the tower's work (``step/rules/trial.py``).
      step: what holds for the whole step traced (:class:`TracedStep`).
      in_loss: within a gathered loss's own call (``step/rules/whole_batch.py``).
    """

    seat: Seat | None = None
    rows: Rows | None = None
    python: random.Random | None = None
    drawn: list[Any] = dataclasses.field(default_factory=list)
    calling: tuple = ()
    skip: Any = None  # a draw's values (a tensor) or None
    moments: dict[int, Any] = dataclasses.field(default_factory=dict)
    trial: Any = None  # rules/trial.Trial, which imports this module
    step: TracedStep | None = None
    in_loss: bool = False


_threads = threading.local()


def this_tower() -> Tower:
    """This thread's :class:`Tower` (a fresh one at its first use)."""
    tower = getattr(_threads, "tower", None)
    if tower is None:
        tower = _threads.tower = Tower()
    return tower


@contextlib.contextmanager
def setting(**values: Any) -> Iterator[Tower]:
    """Within, this thread's tower has ``values`` (by attribute); after, what
    it had before.

    >>> with setting(rows=(2, 0)):
    ...     this_tower().rows
    (2, 0)
    >>> this_tower().rows is None
    True
    """
    tower = this_tower()
    before = {name: getattr(tower, name) for name in values}
    for name, value in values.items():
        setattr(tower, name, value)
    try:
        yield tower
    finally:
        for name, value in before.items():
            setattr(tower, name, value)

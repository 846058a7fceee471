"""The current tower: one object per thread that traces a tower's work, as
tf.distribute's replica context, holding what the step's parts and the
patched Keras calls (``patches.py``) read of it. The package's one
``threading.local``: a tower's thread starts with a fresh one, handed the
step's context (``step``: what holds for the whole step) by the thread that
traces the step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class Tower:
    """This thread's tower.

    Attributes:
      seat: where it meets the other towers (a ``Seat`` in lockstep, a cut
        pass's recording; None: alone), ``step/run/seats.py``.
      rows: its rows of the batch, ``python``: its Python ``random`` while
        it is traced, and ``drawn``: the row counts of its draws so far, in
        call order (``step/rules/places.py``).
      calling: the layers whose ``call`` it is within, and ``skip``: the
        values its next counted draw skips (``patches.py``).
      moments: where BatchNormalization's moments go, by the
        ``MovingStatistics`` recording them (``step/rules/batchnorm.py``).
      trial: the probe's trial of the tower's work (``step/rules/trial.py``).
      step: what holds for the whole step traced (a cluster worker's first
        row, the Python random state one device's trace starts from), shared
        by its towers' threads (``step/rules/places.py``).
      in_loss: within a gathered loss's own call (``step/rules/whole_batch.py``).
    """

    def __init__(self) -> None:
        self.seat: Any = None
        self.rows: Any = None
        self.python: Any = None
        self.drawn: list[Any] = []
        self.calling: tuple = ()
        self.skip: Any = None
        self.moments: dict[int, Any] = {}
        self.trial: Any = None
        self.step: Any = None
        self.in_loss = False


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

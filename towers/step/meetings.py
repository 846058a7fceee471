"""Where the towers meet mid-step: one abstraction, a few verbs.

The whole batch's BatchNormalization moments, a mixture of experts' sums, a
coupled loss's gathered rows, each apply, assignment and metric update of a
model's own step, ``towers.gather``: every meeting goes through a tower's
:class:`Seat`, which :func:`current` returns while the tower is traced to
meet the others, as a replica context's ``all_reduce``, ``all_gather`` and
``merge_call`` serve tf.distribute. Towers traced side by side
(``lockstep.py``) meet at a seat; a pass traced once and cut
(``cut.py``) records its sums instead. Across workers the sums go through
TensorFlow's collective runtime.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

from towers.combine import in_dtype

T = TypeVar("T")
_context = threading.local()


class Seat:
    """Tower ``rank``'s place at ``meet``, with its verbs: :meth:`total` (a
    sum over the towers and workers, with its backward), :meth:`everyone`
    (every tower's value in rank order) and :meth:`from_first` (the first
    tower computes, every tower reads).

    ``weight``: the tower's share when its loss is a mean over its own shard
    (a model's own step): a backward sum then weighs each tower's upstream
    gradient by it and hands back the sum over this tower's weight; None:
    the losses are shares of the step's already. ``own``: the towers run a
    model's own step. ``summing``: while that step takes the gradient of a
    sum over its rows, when a backward sum is unweighted."""

    def __init__(self, meet: Any, rank: int, weight: Any = None, own: bool = False):
        self.meet, self.rank, self.weight, self.own = meet, rank, weight, own
        self.quiet = False  # what the own step assigns is dropped (assignments.py)
        self.summing = False

    @property
    def first(self) -> bool:
        """Whether this is the first tower, the one that acts for all."""
        return self.rank == 0

    @property
    def worker(self) -> tuple[int, int] | None:
        """This worker's index and the number of workers (None: no cluster)."""
        return self.meet.worker

    @property
    def across(self) -> Callable | None:
        """The sum over the cluster's workers (None: no cluster)."""
        return self.meet.across

    def total(self, value: tf.Tensor, backward: bool = False) -> tf.Tensor:
        if not backward or self.weight is None:
            return _total(self.meet, self.rank, value, backward)
        if self.summing:  # every tower's gradient counts whole, as one device's
            return _total(self.meet, self.rank, value)
        weight = in_dtype(self.weight, value.dtype)  # a float64 model's digits
        summed = _total(self.meet, self.rank, value * weight, backward)
        return summed / weight  # only towers with examples run

    def everyone(self, value: Any) -> list[Any]:
        """Hands in ``value``; every tower's, in rank order, once all have."""
        return self.meet.exchange(self.rank, value)

    def from_first(self, compute: Callable[[], T]) -> T:
        """``compute()`` run by the first tower only; every tower reads it."""
        return self.meet.exchange(self.rank, compute() if self.first else None)[0]


def current() -> Any:
    """Where this thread's tower meets the others, when it is traced to meet
    them: a :class:`Seat` in lockstep, or a recording of the meetings
    (``towers/step/segments.py``); None otherwise. Its ``total(value,
    backward)`` is :func:`total`."""
    return getattr(_context, "meeting", None)


@contextlib.contextmanager
def seated(meeting: Any) -> Iterator[None]:
    """Within, :func:`current` is ``meeting`` on this thread (None: outside
    any, as while the first tower runs what it acts on for all)."""
    before = getattr(_context, "meeting", None)
    _context.meeting = meeting
    try:
        yield
    finally:
        _context.meeting = before


def _total(meet: Any, rank: int, value: tf.Tensor, backward: bool = False) -> tf.Tensor:
    """``value`` summed over the towers, then over the workers if any (rank 0
    sends this process's sum; every tower takes the cluster's).

    The sum is wrapped in ``tf.stop_gradient``: its gradient is written out by
    the caller (``towers/step/batchnorm.py``), and a graph walk back from it (as
    ``tf.custom_gradient`` makes, looking for variables) stops there instead
    of running through every other tower's model traced so far, which made
    tracing grow with the square of the depth."""
    local = tf.add_n(meet.exchange(rank, value))
    if meet.across is not None:
        summed = meet.across(local, backward) if rank == 0 else None
        local = meet.exchange(rank, summed)[0]
    return tf.stop_gradient(local)


def total(value: tf.Tensor, backward: bool = False) -> tf.Tensor:
    """The sum of ``value`` over every tower (and worker) in lockstep, on this
    tower's device; no gradient flows back through it. ``backward``: ``value``
    is an upstream gradient of this tower's loss share (across workers it is
    weighted by each worker's examples, see :func:`compute`)."""
    return current().total(value, backward)


def own_step_seat() -> Seat | None:
    """Where this thread's tower meets the others in a model's own step; None
    outside one."""
    here = current()
    return here if isinstance(here, Seat) and here.own else None

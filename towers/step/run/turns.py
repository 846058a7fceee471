"""Towers traced side by side, meeting wherever they need each other's values.

Where a pass cannot be traced once and cut, and for every meeting that is
neither a sum nor an action (gathered rows, a copy per tower's applies),
the towers take turns: a Python thread per tower traces its own ops into
the one graph, one at a time in rank order (a graph's captures are not
safe from two threads), meeting at a :class:`Rendezvous`. A tower that
fails or meets fewer times aborts it; the others fail, never wait."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import keras
import tensorflow as tf

from towers._keras import GlobalSeed, loss_ids_kept
from towers._keras.current import setting, this_tower
from towers.placement.base import Placement
from towers.step.run.seats import Across, Seat, seated

T = TypeVar("T")
# How long a tower waits at a rendezvous while tracing before giving up: tracing
# a large model's towers can take minutes on a busy machine, a deadlock forever.
TRACE_TIMEOUT_SECONDS = 600.0


class Rendezvous:
    """Where ``size`` towers swap values while they are traced in turns: one
    traces at a time, in rank order, handing the turn on at each meeting, so
    the graph is built in one order every time.

    Example:
      >>> meet = Rendezvous(2)
      >>> meet.begin()
      >>> out = [None, None]
      >>> def tower(rank):
      ...     meet.start(rank)
      ...     out[rank] = meet.exchange(rank, f"from {rank}")
      ...     meet.finish(rank)
      >>> threads = [threading.Thread(target=tower, args=(r,)) for r in (0, 1)]
      >>> for thread in threads: thread.start()
      >>> for thread in threads: thread.join()
      >>> out
      [['from 0', 'from 1'], ['from 0', 'from 1']]
    """

    def __init__(
        self,
        size: int,
        timeout: float = TRACE_TIMEOUT_SECONDS,
        across: Across | None = None,
        keep: Callable[[], Callable[[], None]] | None = None,
        device: str | None = None,
    ):
        self.size = size
        self.device = device  # where the towers' shared objects are made
        # keep(): what a tower's thread keeps of shared Python state while the
        # others take their turns; it returns the call that puts it back.
        self.keep = keep
        # In a cluster, the sums over the workers (called by rank 0 only), and
        # (this worker's index, the number of workers).
        self.across = across
        self.worker = None if across is None else across.where
        self.timeout = timeout
        self._turn = threading.Condition()
        self._holder = 0  # the rank whose turn it is
        self._done = [False] * size  # the towers traced in this round
        self._aborted = False
        self._calls = [0] * size
        self._slots: dict[int, list[Any]] = {}
        self._handed: dict[int, int] = {}  # per call, the towers that handed in
        self.marks: dict[Any, Any] = {}  # the seats' (seats.Seat.marks)
        self.forms: dict[Any, Any] = {}

    def begin(self) -> None:
        """A new round of tracing (the forward passes, then the backward ones):
        tower 0 goes first."""
        with self._turn:
            self._holder, self._done = 0, [False] * self.size

    def start(self, rank: int) -> None:
        """Waits for tower ``rank``'s first turn."""
        self._wait(rank)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Hands in ``value`` as tower ``rank``; returns every tower's, in rank
        order, once all have handed in theirs for this call."""
        call = self._calls[rank]
        self._calls[rank] += 1
        slots = self._slots.setdefault(call, [None] * self.size)
        slots[rank] = value
        self._handed[call] = self._handed.get(call, 0) + 1
        put_back = self.keep() if self.keep is not None else None
        self._hand_on(rank)
        self._wait(rank)  # back to this rank: every tower has had its turn
        if put_back is not None:
            put_back()
        if self._handed[call] != self.size:  # one finished without this call
            self.abort()
            raise threading.BrokenBarrierError(
                "the towers met a different number of times: they must run the "
                "same model"
            )
        return list(slots)

    def finish(self, rank: int) -> None:
        """Tower ``rank`` is traced: the turn goes on without it."""
        self._done[rank] = True
        self._hand_on(rank)

    def abort(self) -> None:
        """Wakes every waiting tower with ``threading.BrokenBarrierError``."""
        with self._turn:
            self._aborted = True
            self._turn.notify_all()

    def _hand_on(self, rank: int) -> None:
        with self._turn:
            for step in range(1, self.size + 1):
                following = (rank + step) % self.size
                if not self._done[following]:
                    self._holder = following
                    break
            self._turn.notify_all()

    def _wait(self, rank: int) -> None:
        with self._turn:
            ready = self._turn.wait_for(
                lambda: self._holder == rank or self._aborted, self.timeout
            )
            if self._aborted or not ready:
                self._aborted = True
                self._turn.notify_all()
                raise threading.BrokenBarrierError(
                    f"tower {rank} waited {self.timeout:g} s for its turn"
                )


def meeting(size: int, placement: Placement, across: Across | None) -> Rendezvous:
    """The rendezvous of ``size`` towers of ``placement`` (``across``: the
    step's handle on the other workers, or None)."""
    return Rendezvous(
        size, across=across, keep=kept(placement.models),
        device=placement.variable_device,
    )  # fmt: skip


def kept(models: list[keras.Model]) -> Callable[[], Callable[[], None]]:
    """What a tower keeps while the others trace: its layers' ids of the
    ``add_loss`` terms of its call, which each call clears (``towers/_keras``)."""
    return functools.partial(loss_ids_kept, models)


def in_lockstep(
    works: Sequence[Callable[[], T]],
    meet: Rendezvous,
    weights: Sequence[Any] | None = None,
    own: bool = False,
) -> list[T]:
    """Traces ``works`` (one per tower, rank order) each in its own thread into
    the current graph, meeting at ``meet`` (``weights``: each tower's share;
    ``own``: a model's own step); returns their results, or raises the first
    error a tower raised.

    Example:
      >>> from towers.step.run.seats import total
      >>> @tf.function
      ... def step(x):
      ...     meet = Rendezvous(2)
      ...     works = [lambda part=part: total(tf.reduce_sum(part))
      ...              for part in tf.split(x, 2)]
      ...     return in_lockstep(works, meet)
      >>> [float(each) for each in step(tf.constant([1.0, 2.0, 3.0, 4.0]))]
      [10.0, 10.0]
    """
    graph = tf.compat.v1.get_default_graph()
    results: list[Any] = [None] * len(works)
    errors: list[BaseException] = []
    seed = GlobalSeed(meet.device)  # Keras keeps it per thread
    step = this_tower().step  # the step's context, every tower's thread's

    def trace(rank: int, work: Callable[[], T]) -> None:
        try:
            weight = None if weights is None else weights[rank]
            seat = Seat(meet, rank, weight, own)
            with seated(seat), seed.in_thread(), setting(step=step):
                meet.start(rank)
                with graph.as_default():
                    results[rank] = work()
                meet.finish(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller
            errors.append(error)
            meet.abort()

    meet.begin()
    threads = [
        threading.Thread(target=trace, args=(rank, work), name=f"tower-{rank}")
        for rank, work in enumerate(works)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seed.kept()
    first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if first or errors:
        raise (first or errors)[0]
    return results

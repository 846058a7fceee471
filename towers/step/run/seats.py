"""Where the towers meet mid-step: one abstraction, a few verbs.

The whole batch's BatchNormalization moments, a mixture of experts' sums, a
coupled loss's gathered rows, each apply, assignment and metric update of a
model's own step, ``towers.gather``: every meeting goes through a tower's
:class:`Seat`, which :func:`current` returns while the tower is traced to
meet the others, as a replica context's ``all_reduce``, ``all_gather`` and
``merge_call`` serve tf.distribute. Towers traced side by side
(``turns.py``) meet at a seat; a pass traced once and cut
(``cut.py``) records its sums instead. Across workers the sums go through
TensorFlow's collective runtime, by the step's one handle on the other
workers (:class:`Across`), whichever way the towers run.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

from towers._keras.current import setting, this_tower
from towers.combine import in_dtype
from towers.step.rules.state import Form, form_of

T = TypeVar("T")
# A collective's key fixes the shapes it carries: a tensor whose rows only the
# run knows (a gathered batch) is padded to a power of two and takes one of
# this many keys reserved for it, by that power.
SIZE_BUCKETS = 32


class Unserved(Exception):
    """The seat protocol's one signal: a verb the way the towers run cannot
    serve (a cut pass cannot gather rows; a pass traced once for towers that
    do not meet cannot sum). Its message says why; the runner
    (``Runner._train``) takes the next way."""


class Seat:
    """Tower ``rank``'s place at ``meet``, with its verbs: :meth:`total` (a
    sum over the towers and workers, with its backward), :meth:`everyone`
    (every tower's value in rank order), :meth:`from_first` (the first
    tower computes, every tower reads) and :meth:`once` (an action run once
    with every tower's value: an apply, an assignment).

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
        self.inputs: Any = ()  # the tower's own inputs, apart from the step's

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
        if not backward or self.weight is None or self.summing:
            return self._total(value, backward and not self.summing)
        weight = in_dtype(self.weight, value.dtype)  # a float64 model's digits
        return self._total(value * weight, backward) / weight  # rows here

    def _total(self, value: tf.Tensor, backward: bool) -> tf.Tensor:
        """``value`` summed over the towers, then the workers (rank 0 sends
        this process's sum; every tower takes the cluster's)."""
        handed = self.meet.exchange(self.rank, value)
        if self.across is None:
            return summed(handed)
        total = summed(handed, self.across, backward) if self.first else None
        return self.meet.exchange(self.rank, total)[0]

    def everyone(self, value: Any) -> list[Any]:
        """Hands in ``value``; every tower's, in rank order, once all have."""
        return self.meet.exchange(self.rank, value)

    def from_first(self, compute: Callable[[], T]) -> T:
        """``compute()`` run by the first tower only; every tower reads it."""
        return self.meet.exchange(self.rank, compute() if self.first else None)[0]

    def once(self, value: Any, action: Callable[[list], T], writes=None) -> T | None:
        """Hands in ``value``; ``action(every tower's)`` runs once, for all,
        as the first tower (what it returns, there; None on the others).
        ``writes``: the variables it changes (a cut pass orders by them)."""
        handed = self.everyone(value)
        if not self.first:
            return None
        with seated(None):
            return action(handed)

    def form(self, value: Any, marks: dict, forms: dict) -> Any:
        """``value``'s form (``state.form_of``), to compare with the other
        towers': each tower's ops are its own in the one graph."""
        return Form(form_of(value, (), marks, None, forms))


class Alone:
    """The seat of a tower that meets nobody (one tower, no cluster; or
    outside a step): its verbs serve it as the only tower."""

    rank, first, worker, across, weight, own = 0, True, None, None, None, False
    quiet = summing = False
    inputs: Any = ()

    def total(self, value: tf.Tensor, backward: bool = False) -> tf.Tensor:
        return summed([value])

    def everyone(self, value: Any) -> list[Any]:
        return [value]

    def from_first(self, compute: Callable[[], T]) -> T:
        return compute()

    def once(self, value: Any, action: Callable[[list], T], writes=None) -> T:
        with seated(None):
            return action([value])

    def form(self, value: Any, marks: dict, forms: dict) -> Any:
        return Form(form_of(value, (), marks, None, forms))


ALONE = Alone()


def summed(handed: list[tf.Tensor], across: Any = None, backward=False) -> tf.Tensor:
    """The towers' ``handed`` values summed (then over the workers, with
    ``across``): the one sum every meeting takes. No gradient flows back
    through it: its caller writes it (``towers/step/rules/batchnorm.py``), and a
    graph walk from it (``tf.custom_gradient``'s, for variables) stops here
    instead of running through every tower traced so far (a trace that grew
    with the square of the depth)."""
    local = tf.add_n(handed)
    if across is not None:
        local = across(local, backward)
    return tf.stop_gradient(local)


def current() -> Any:
    """Where this thread's tower meets the others: a :class:`Seat` in
    lockstep, a recording of its sums while traced to be cut
    (``towers/step/run/cut.py``), else :data:`ALONE`."""
    return this_tower().seat or ALONE


@contextlib.contextmanager
def seated(meeting: Any) -> Iterator[None]:
    """Within, :func:`current` is ``meeting`` on this thread (None: outside
    any, as while the first tower runs what it acts on for all)."""
    with setting(seat=meeting):
        yield


def total(value: tf.Tensor, backward: bool = False) -> tf.Tensor:
    """The sum of ``value`` over every tower (and worker) this tower meets,
    on its device; no gradient flows back through it. ``backward``: ``value``
    is an upstream gradient of this tower's loss share (across workers it is
    weighted by each worker's examples, ``Across``)."""
    return current().total(value, backward)


class Across:
    """The one handle on a cluster's other workers for one ``kind`` step's
    meetings (``"train"``, ``"eval"``, ``"predict"``), made by the runner:
    ``across(value, backward)`` is ``value`` summed over the workers, the
    sums numbered in the order they are made (the same on every worker).

    ``weight``: this worker's weight in the step (its examples, or its share
    ``B_w / B``), once known: a backward sum weighs each worker's upstream
    gradient by it, as its gradients are weighed."""

    def __init__(self, workers: Any, kind: str):
        self.workers, self.kind = workers, kind
        self.weight: Any = None
        self._instances = itertools.count()

    @property
    def where(self) -> tuple[int, int]:
        """This worker's index and the number of workers."""
        return self.workers.cluster.index, self.workers.cluster.num_workers

    def __call__(self, value: tf.Tensor, backward: bool, bucket: Any = None):
        sum_statistics = self.workers.sum_statistics
        if bucket is not None:  # a size only the run knows: see SIZE_BUCKETS
            first = next(self._instances)
            for _ in range(SIZE_BUCKETS - 1):
                next(self._instances)
            return sum_statistics(value, (first, bucket), self.kind)
        if not backward or self.weight is None:  # statistics, or a sum loss
            return sum_statistics(value, next(self._instances), self.kind)
        scale = tf.cast(self.weight, value.dtype)
        summed = sum_statistics(value * scale, next(self._instances), self.kind)
        return tf.math.divide_no_nan(summed, scale)  # an empty worker: 0


def over_workers(across: Across | None, value: Any, by_examples=True) -> tf.Tensor:
    """``value`` summed over a cluster's workers, each weighted by its share
    of the global batch (``across.weight``, ``by_examples``) or by 1, a
    worker without examples by 0 whatever its value; ``value`` itself
    without a cluster."""
    value = tf.convert_to_tensor(value)
    if across is None:
        return value
    weight = in_dtype(across.weight, value.dtype)
    if not by_examples:
        weight = tf.cast(weight > 0, value.dtype)
    return across(tf.math.multiply_no_nan(value, weight), False)

"""Where the towers meet mid-step: one abstraction, a few verbs.

Every meeting (the whole batch's BatchNormalization moments, a mixture of
experts' sums, a coupled loss's gathered rows, each apply, assignment and
metric update of a model's own step, ``towers.gather``) goes through the
seat :func:`current` returns while a tower is traced, as a replica
context's ``all_reduce``, ``all_gather`` and ``merge_call`` serve
tf.distribute: a :class:`Seat` in turns, a :class:`CutSeat` while a pass is
traced to be cut, :data:`ALONE` for a tower that meets nobody. Across
workers the sums go through TensorFlow's collective runtime by the step's
one handle on them (:class:`Across`), whichever way the towers run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

from towers._keras.current import setting, this_tower
from towers.cluster.workers import Workers
from towers.combine import in_dtype
from towers.step.rules.forms import Form, form_of

T = TypeVar("T")
# A collective's key fixes the shapes it carries: a tensor whose rows only the
# run knows (a gathered batch) is padded to a power of two and takes one of
# this many keys reserved for it, by that power.
SIZE_BUCKETS = 32


class Unserved(Exception):
    """A verb the way the towers run cannot serve (a cut pass cannot gather
    rows; a pass traced once for towers that do not meet cannot sum): the
    runner takes the next way (``runner.NEXT``)."""


class Seat:
    """Tower ``rank``'s place at ``meet`` (a ``turns.Rendezvous``). ``weight``:
    its share where its loss is a mean over its own shard (a model's own
    step): a backward sum then weighs its upstream gradient by it;
    ``summing``: while that step takes a sum's gradient, unweighted."""

    def __init__(self, meet: Any, rank: int, weight: Any = None, own: bool = False):
        self.meet, self.rank, self.weight, self.own = meet, rank, weight, own
        self.quiet = False  # what the own step assigns is dropped (assignments.py)
        self.summing = False
        self.inputs: Any = ()  # the tower's own inputs, apart from the step's
        # What the towers met for (tensor -> its meeting: one value on every
        # tower) and the forms found (``forms.form_of``), the meeting's.
        self.marks, self.forms = meet.marks, meet.forms

    @property
    def first(self) -> bool:
        return self.rank == 0  # the tower that acts for all

    @property
    def worker(self) -> tuple[int, int] | None:
        return self.meet.worker  # (this worker's index, the workers), or None

    @property
    def across(self) -> Callable | None:
        return self.meet.across

    def total(self, value: tf.Tensor, backward: bool = False) -> tf.Tensor:
        """``value`` summed over the towers and workers, with its backward
        (``backward``: ``value`` is an upstream gradient)."""
        if not backward or self.weight is None or self.summing:
            return self._total(value, backward and not self.summing)
        weight = in_dtype(self.weight, value.dtype)  # a float64 model's digits
        return self._total(value * weight, backward) / weight  # rows here

    def _total(self, value: tf.Tensor, backward: bool) -> tf.Tensor:
        # Rank 0 sends this process's sum over the workers; every tower
        # takes the cluster's.
        handed = self.meet.exchange(self.rank, value)
        if self.across is None:
            return summed(handed)
        total = summed(handed, self.across, backward) if self.first else None
        return self.meet.exchange(self.rank, total)[0]

    def everyone(self, value: Any) -> list[Any]:
        """Every tower's ``value``, in rank order."""
        return self.meet.exchange(self.rank, value)

    def from_first(self, compute: Callable[[], T]) -> T:
        """``compute()`` run by the first tower; every tower reads it."""
        return self.meet.exchange(self.rank, compute() if self.first else None)[0]

    def once(self, value: Any, action: Callable[[list], T], writes=None) -> T | None:
        """``action(every tower's value)`` run once, as the first tower (its result
        there, None elsewhere); ``writes``: what it changes (a cut orders by it)."""
        handed = self.everyone(value)
        if not self.first:
            return None
        with seated(None):
            return action(handed)

    def form(self, value: Any) -> Any:
        """``value``'s form (``forms.form_of``), to compare with the other
        towers': each tower's ops are its own in the one graph."""
        return Form(form_of(value, (), self.marks, None, self.forms))


class Alone:
    """The seat of a tower that meets nobody (one tower, no cluster; or
    outside a step): its verbs serve it as the only tower."""

    rank, first, worker, across, weight, own = 0, True, None, None, None, False
    quiet = summing = False
    inputs: Any = ()

    @property
    def marks(self) -> dict:  # one tower: what it meets for is its own
        return {}

    forms = marks

    def total(self, value: tf.Tensor, backward: bool = False) -> tf.Tensor:
        return summed([value])

    def everyone(self, value: Any) -> list[Any]:
        return [value]

    def from_first(self, compute: Callable[[], T]) -> T:
        return compute()

    def once(self, value: Any, action: Callable[[list], T], writes=None) -> T:
        with seated(None):
            return action([value])

    form = Seat.form


ALONE = Alone()


@dataclasses.dataclass
class Sum:
    """A sum as a traced pass made it: the tower's value, the sum's placeholder."""

    value: tf.Tensor
    result: tf.Tensor
    backward: bool
    phase: int = 0


@dataclasses.dataclass
class Action:
    """An action run once with every tower's ``value``, as a traced pass met
    it: what it ``writes`` (None: any) and the ops ``made`` before it."""

    value: Any
    action: Callable[[list], Any]
    writes: list[Any] | None
    made: int
    phase: int = 0


class CutSeat(Alone):
    """The seat of a pass traced alone to be cut: a sum becomes a placeholder,
    an action is recorded; rows and code on one tower it cannot serve, nor a
    sum unless the towers were sent to meet (``meets``)."""

    marks = forms = None  # its own, where Alone has none to keep

    def __init__(self, meets: bool, own: bool = False) -> None:
        self.meetings: list[Sum | Action] = []
        self.marks: dict[Any, Any] = {}
        self.forms: dict[Any, Any] = {}
        self.meets, self.own = meets, own
        self.graph: Any = None
        self.inputs: list[tf.Tensor] = []  # the tower's own: its rows, its share

    def everyone(self, value: Any) -> list[Any]:
        raise Unserved("the towers' pass gathers rows")

    def from_first(self, compute: Callable[[], Any]) -> Any:
        raise Unserved("the towers' pass runs code on one tower")

    total = Seat.total  # a share weighs a backward sum, as at a Seat

    def _total(self, value: tf.Tensor, backward: bool) -> tf.Tensor:
        if not self.meets:
            raise Unserved("the towers' pass meets at a sum")
        result = tf.raw_ops.Placeholder(
            dtype=value.dtype, shape=value.shape, name="towers_sum"
        )
        self.meetings.append(Sum(value, result, backward))
        return result

    def once(self, value: Any, action: Callable[[list], Any], writes=None) -> None:
        graph = tf.compat.v1.get_default_graph()
        if not self.meets or graph is not self.graph:
            raise Unserved("the towers' pass meets inside a loop or branch")
        made = len(graph.get_operations())
        self.meetings.append(Action(value, action, writes, made))

    def form(self, value: Any) -> Any:
        # A tower's own inputs read are its rows; a capture is named by what
        # it captures: every tower's trace of this pass makes the same form.
        captured = {id(inner): ("captured", id(outer))
                    for outer, inner in self.graph.captures}  # fmt: skip
        return Form(form_of(value, self.inputs, self.marks, captured, self.forms))


def summed(
    handed: list[tf.Tensor], across: Across | None = None, backward=False
) -> tf.Tensor:
    """The towers' values summed (then over the workers): the one sum every
    meeting takes. No gradient flows back (its caller writes one): a graph
    walk from it stops here, not through every tower traced so far."""
    local = tf.add_n(handed)
    if across is not None:
        local = across(local, backward)
    return tf.stop_gradient(local)


def current() -> Any:
    """Where this thread's tower meets the others (:data:`ALONE` outside)."""
    return this_tower().seat or ALONE


@contextlib.contextmanager
def seated(meeting: Any) -> Iterator[None]:
    """Within, :func:`current` is ``meeting`` on this thread (None: outside
    any, as while the first tower runs what it acts on for all)."""
    with setting(seat=meeting):
        yield


def total(value: tf.Tensor, backward: bool = False) -> tf.Tensor:
    """The sum of ``value`` over every tower (and worker) this tower meets,
    on its device (:meth:`Seat.total`); no gradient flows back through it."""
    return current().total(value, backward)


class Across:
    """The step's one handle on a cluster's other workers for a ``kind`` step:
    ``across(value, backward)`` sums over the workers, numbered in the order
    made; ``weight``: this worker's in the step, weighing a backward sum."""

    def __init__(self, workers: Workers | None, kind: str):
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
    """``value`` summed over the workers, each weighted by its share of the
    global batch (or by 1), a worker without examples by 0."""
    value = tf.convert_to_tensor(value)
    if across is None:
        return value
    weight = in_dtype(across.weight, value.dtype)
    if not by_examples:
        weight = tf.cast(weight > 0, value.dtype)
    return across(tf.math.multiply_no_nan(value, weight), False)

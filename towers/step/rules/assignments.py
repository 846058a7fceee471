"""What a model's own step changes besides its applies, changed once, as one
device changes it.

Each variable the step assigns (an EMA copy, a target network, a queue, a
raw ``tf.Variable``) and each metric it updates is a meeting, as an apply
is: every tower hands in its value, the first assigns once, every tower
reads the new value after. A variable takes its ``aggregation``'s rule
(``state.py``); ``"none"`` takes one value where every tower's has one form
(``forms.form_of``), adds the batch's loss where each tower adds its own (a
running total), and is refused by name otherwise. A ``keras.metrics.Mean``
given one number for the batch is updated once with the towers' numbers
weighted by their shares; any other update adds the towers' changes, unless
every tower's is the same. With a copy per tower, each copy changes its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras import in_stateless_scope, layers_of
from towers._keras.patches import (
    Patch,
    calling,
    raw_assignments,
    routed_assignments,
    routed_calls,
    tracked_calls,
)
from towers.combine import in_dtype
from towers.step.rules.forms import form_of
from towers.step.rules.metric_updates import (
    MetricUpdates,
    check_same,
    every_metric,
    same_form,
)
from towers.step.rules.state import aggregate, raw_variables, refused, rule_of
from towers.step.run.seats import Across, current, over_workers


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within, what this tower's own step assigns and updates is dropped: a
    loss computed again only for a part of its gradient (``whole_batch.py``)."""
    seat = current()
    before = seat.quiet
    seat.quiet = True
    try:
        yield
    finally:
        seat.quiet = before


class Assignments(MetricUpdates):
    """Routes what a model's own step assigns and updates to the towers'
    meetings while the step is traced.

    Args:
      models: the models the towers run (one: the towers share it).
      across: in a cluster, the step's handle on the workers (``seats.Across``).
      apart: the copies never meet (``placement="independent"``)."""

    def __init__(
        self, models: list[keras.Model], across: Across | None, apart: bool = False
    ):
        super().__init__()
        self.models = models
        self.apart = apart
        self.across = across
        self.loss_kind: Any = lambda value: None  # Applies.loss_kind
        self.assigned: list[str] = []  # what the step assigned, when traced
        # BatchNormalization's moving statistics, assigned in the layer's
        # call, meet on their own (another assignment of them meets here).
        normalising = keras.layers.BatchNormalization
        self._normalising = [
            layer
            for m in models
            for layer in layers_of(m)
            if isinstance(layer, normalising)
        ]
        self._passed = {
            id(v): layer
            for layer in self._normalising
            for v in (layer.moving_mean, layer.moving_variance)
        }
        # With a copy per tower: each variable's place in its copy, where the
        # copies' variables correspond.
        self._place = {id(v): i for m in models for i, v in enumerate(m.variables)}
        self._own: Any = None
        self._names: dict[int, str] = {}  # a raw tf.Variable's, by id

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """Within, the towers meet at each assignment and metric update (with a
        copy per tower, at each assignment: ``copies.gather_metrics`` adds their
        metrics' changes)."""
        if self.apart:
            yield
            return
        metrics = [m for model in self.models for m in every_metric(model)]
        raw = [v for model in self.models for v, _ in raw_variables(model)]
        self._names = {id(v): n for m in self.models for v, n in raw_variables(m)}
        # With a copy per tower: each metric's place in its copy's.
        self._metric_place = {id(m): i for model in self.models
                              for i, m in enumerate(every_metric(model))}  # fmt: skip
        with (
            Patch(lambda: tracked_calls(self._normalising)).applied(),
            routed_assignments(self._assign) as own,
            Patch(lambda: raw_assignments(raw, self._raw)).applied(),
            routed_calls(metrics, "update_state", self._update),
            routed_calls(metrics, "result", self._result),
        ):
            self._own = own
            yield

    def _assign(self, variable: Any, value: Any, assign: Any) -> Any:
        here = current()
        layer = self._passed.get(id(variable))
        if not here.own or in_stateless_scope() or (layer and calling(layer)):
            return assign(value)
        if here.quiet:
            return value
        value = keras.ops.convert_to_tensor(value, variable.dtype)  # cast, as Keras
        if here.first:
            self.assigned.append(self._name(variable))
        if len(self.models) > 1:
            return self._assign_copies(here, variable, value, assign)

        def once(handed: list) -> Any:
            check_same(handed, variable)
            _, values, shares, forms, added = (list(h) for h in zip(*handed))
            same = same_form(forms)
            added = added[0] if len(set(added)) == 1 else None
            with tf.name_scope("assignments/"):
                return assign(self._combine(variable, values, shares, same, added))

        form = here.form(value)
        added = self._loss_added(variable, value)
        done = here.once((variable, value, here.weight, form, added), once, [variable])
        return value if done is None else done

    def _raw(self, variable: tf.Variable, value: tf.Tensor) -> Any:
        return self._assign(variable, value, type(variable).assign.__get__(variable))

    def _loss_added(self, variable: Any, value: tf.Tensor) -> str | None:
        # The kind of the loss value adds to variable (or takes from it), or None.
        if not tf.is_symbolic_tensor(value) or value.op.type not in ("AddV2", "Sub"):
            return None
        read, loss = value.op.inputs
        if value.op.type == "AddV2" and self.loss_kind(read) is not None:
            read, loss = loss, read
        kind = self.loss_kind(loss)
        return kind if kind is not None and _reads(read, variable) else None

    def _assign_copies(self, here: Any, variable: Any, value: Any, assign: Any):
        # With a copy per tower: one value, combined, each copy its own variable.
        place = self._place.get(id(variable))
        if place is None:  # not a copy's own (an optimizer's)
            return assign(value)
        handed = here.everyone((place, value, here.weight))
        check_same(handed, place)
        values = [value for _, value, _ in handed]
        shares = [share for *_, share in handed]
        same = alike(values, _corresponding(self.models), here.marks)
        combined = here.from_first(
            lambda: self._combine(variable, values, shares, same)
        )
        with tf.name_scope("assignments/"):
            return assign(combined)

    def _combine(
        self, variable: Any, values: list, shares: list, same: bool, added=None
    ) -> tf.Tensor:
        # What variable takes from the towers' values by its aggregation (same:
        # every form the first's; added: the kind of the loss each added to it).
        rule = rule_of(variable)
        if rule == "none" and not same and added is not None:
            rule = "mean" if added == "mean" else "sum"  # the batch's loss
        if len(values) == 1 and self.across is None:
            return values[0]
        if rule == "only_first_replica" or (rule == "none" and same):
            return values[0]  # in a cluster, the same on every worker
        if rule in ("sum", "mean"):  # state.py's rules, over every worker's
            before = tf.convert_to_tensor(variable)
            change, weight = aggregate(rule, before, values, shares)
            change = over_workers(self.across, change, rule == "mean")
            if rule == "mean":
                weight = in_dtype(weight, before.dtype)
                change = change / over_workers(self.across, weight)
            return before + change
        raise refused(self._name(variable), rule)

    def _name(self, variable: Any) -> str:
        return getattr(variable, "path", None) or self._names[id(variable)]


def _reads(tensor: tf.Tensor, variable: Any) -> bool:
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    captures = getattr(tf.compat.v1.get_default_graph(), "captures", [])
    handle = {id(o): i for o, i in captures}.get(id(variable.handle), variable.handle)
    return tensor.op.type == "ReadVariableOp" and tensor.op.inputs[0] is handle


def alike(values: list[tf.Tensor], corresponding: Any = None, marks=None) -> bool:
    """Whether every tower's value has the first's form (``forms.form_of``),
    captured variables by ``corresponding`` place in a copy where given.

    >>> x = tf.constant([1.0, 2.0])
    >>> alike([x * 2.0, x * 2.0]), alike([x * 2.0, x * 3.0])
    (True, False)
    """
    if all(v is values[0] for v in values):
        return True
    forms: dict = {}  # shared: a subgraph every tower reads, walked once
    found = [form_of(v, (), marks, corresponding, forms) for v in values]
    return found[0] is not None and all(f == found[0] for f in found)


def _corresponding(models: list[keras.Model]) -> dict[int, int]:
    # Each captured handle of a copy's variable (by id) -> its place in its copy.
    place = {id(v.value.handle): i for m in models for i, v in enumerate(m.variables)}
    graph = tf.compat.v1.get_default_graph()
    captures = getattr(graph, "captures", [])
    return {id(inner): place[id(outer)] for outer, inner in captures
            if id(outer) in place}  # fmt: skip

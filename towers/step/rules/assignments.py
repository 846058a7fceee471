"""What a model's own step changes besides its applies, changed once, as one
device changes it.

Left alone, every tower would assign a variable the step assigns (an EMA
copy, a target network, a queue of keys, a raw ``tf.Variable`` the model
holds) and update a metric it updates. So each is a meeting, as an apply
is: every tower hands in what it would assign, the first assigns once, and
every tower reads the new value after. A variable takes its
``aggregation``'s rule (``state.py``); ``"none"`` takes the first tower's
value only when every tower's is the same value (the same ops on the same
variables and constants, or on what the towers met for, ``towers.gather``'s
rows), or adds the batch's loss where each tower's adds its loss (a running
total, ``Applies.loss_kind``), and is refused by name before any update
otherwise.

A metric update is one update on the whole batch: a ``keras.metrics.Mean``
given one number for the batch (a tracker fed the step's loss, a sum's as a
mean's, ``loss_kinds.py``) is updated once with the towers' numbers weighted
by their shares; any other update adds the towers' changes up, unless every
tower's is the same. Seed states move once (``draws.py``), BatchNormalization's
moving statistics at each call; with a copy per tower, each copy changes its
own.
"""

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
from towers.step.rules.state import aggregate, form_of, raw_variables, refused, rule_of
from towers.step.run.seats import current, over_workers

# Tensors the towers met for, by the meeting that made them: the same value
# on every tower. Kept while a step's towers are traced (``routed``); the
# towers' threads take turns, so one dict serves them all.
_MARKS: dict[Any, Any] = {}
_FORMS: dict[Any, Any] = {}  # the forms found, by tensor (state.form_of)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within, what this tower's own step assigns and updates is dropped
    (its seat says so): a loss computed again only for a part of its
    gradient (``towers/step/rules/whole_batch.py``). Every tower is quiet alike, so
    they still meet alike."""
    seat = current()
    before = seat.quiet
    seat.quiet = True
    try:
        yield
    finally:
        seat.quiet = before


def met_for(tensors: list[tf.Tensor], meeting: Any) -> None:
    """Marks ``tensors`` as one meeting's result (``meeting``: the same on
    every tower), the same value on every tower."""
    for tensor in tensors:
        _MARKS[tensor.ref()] = meeting


class Assignments:
    """Routes what a model's own step assigns and updates to the towers'
    meetings while the step is traced.

    Args:
      models: the models the towers run (one: the towers share it).
      across: in a cluster, ``across(value, backward)``: ``value`` summed
        over the workers (one collective, in trace order on every worker);
        None in one process.
      apart: the copies never meet (``placement="independent"``).
    """

    def __init__(self, models: list[Any], across: Any, apart: bool = False):
        self.models = models
        self.apart = apart
        self.across = across
        # A loss value as a mean over the tower's rows (Applies.as_mean).
        self.as_mean: Any = lambda value: value
        self.loss_kind: Any = lambda value: None  # Applies.loss_kind
        self.assigned: list[str] = []  # what the step assigned, when traced
        # A metric's result() the step read, by its values' ids (when traced).
        self._results: dict[Any, Any] = {}
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
        """Within, the towers meet at each assignment and metric update (with
        a copy per tower, at each assignment: the copies' metric updates are
        gathered into copy 0's, ``custom_copies.gather_metrics``)."""
        if self.apart:
            yield
            return
        metrics = [m for model in self.models for m in _every_metric(model)]
        raw = [v for model in self.models for v, _ in raw_variables(model)]
        self._names = {id(v): n for m in self.models for v, n in raw_variables(m)}
        # With a copy per tower: each metric's place in its copy's.
        self._metric_place = {id(m): i for model in self.models
                              for i, m in enumerate(_every_metric(model))}  # fmt: skip
        _MARKS.clear()
        _FORMS.clear()
        try:
            with (
                Patch(lambda: tracked_calls(self._normalising)).applied(),
                routed_assignments(self._assign) as own,
                Patch(lambda: raw_assignments(raw, self._raw)).applied(),
                routed_calls(metrics, "update_state", self._update),
                routed_calls(metrics, "result", self._result),
            ):
                self._own = own
                yield
        finally:
            _MARKS.clear()
            _FORMS.clear()

    def is_result(self, value: Any) -> bool | None:
        """Whether ``value`` (one the step returns) is a metric's
        ``result()``, read by the step; None when not known (copies)."""
        if self.apart or len(self.models) > 1:
            return None
        leaves = tf.nest.flatten(value)
        return bool(leaves) and all(id(leaf) in self._results for leaf in leaves)

    def note(self, value: Any, result: bool | None) -> None:
        """``value`` (a log the step returned, as run) is a metric's result
        where ``result`` (:meth:`is_result` of it as traced)."""
        if result:
            self._results[id(value)] = (None, value)

    def _result(self, metric: Any, result: Any, args: tuple, kwargs: dict) -> Any:
        value = result(*args, **kwargs)
        for leaf in tf.nest.flatten(value):
            self._results[id(leaf)] = (metric, leaf)  # kept: its id stays its own
        return value

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
            _check_same(handed, variable)
            _, values, shares, forms, added = (list(h) for h in zip(*handed))
            same = _same(forms)
            added = added[0] if len(set(added)) == 1 else None
            with tf.name_scope("assignments/"):
                return assign(self._combine(variable, values, shares, same, added))

        form = here.form(value, _MARKS, _FORMS)
        added = self._loss_added(variable, value)
        done = here.once((variable, value, here.weight, form, added), once, [variable])
        return value if done is None else done

    def _raw(self, variable: tf.Variable, value: tf.Tensor) -> Any:
        return self._assign(variable, value, type(variable).assign.__get__(variable))

    def _loss_added(self, variable: Any, value: tf.Tensor) -> str | None:
        """The kind of the loss ``value`` adds to (or takes from) ``variable``:
        one the step took the gradient of; else None."""
        if not tf.is_symbolic_tensor(value) or value.op.type not in ("AddV2", "Sub"):
            return None
        read, loss = value.op.inputs
        if value.op.type == "AddV2" and self.loss_kind(read) is not None:
            read, loss = loss, read
        kind = self.loss_kind(loss)
        return kind if kind is not None and _reads(read, variable) else None

    def _assign_copies(self, here: Any, variable: Any, value: Any, assign: Any):
        """With a copy per tower: the copies' corresponding variables take one
        value, combined as one variable's would be, each in its own copy."""
        place = self._place.get(id(variable))
        if place is None:  # not a copy's own (an optimizer's)
            return assign(value)
        handed = here.everyone((place, value, here.weight))
        _check_same(handed, place)
        values = [value for _, value, _ in handed]
        shares = [share for *_, share in handed]
        same = alike(values, _corresponding(self.models))
        combined = here.from_first(
            lambda: self._combine(variable, values, shares, same)
        )
        with tf.name_scope("assignments/"):
            return assign(combined)

    def _combine(
        self, variable: Any, values: list, shares: list, same: bool, added=None
    ) -> tf.Tensor:
        """What ``variable`` takes from the towers' ``values`` (of ``shares``
        of the batch; ``same``: every one's form the first's; ``added``: the
        kind of the loss each added to it), by its aggregation."""
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
        """A Keras variable's path; a raw tf.Variable's layer and attribute."""
        return getattr(variable, "path", None) or self._names[id(variable)]

    def _update(self, metric: Any, update: Any, args: tuple, kwargs: dict) -> Any:
        here = current()
        if not here.own or in_stateless_scope():
            return update(*args, **kwargs)
        if here.quiet:
            return None
        variables, own = list(metric.variables), self._own
        value = self.as_mean(_batch_number(args, kwargs))
        copies = len(self.models) > 1
        if isinstance(metric, keras.metrics.Mean) and value is not None:
            # The batch's number: the towers' weighted, in one update (with
            # copies, of the first's copy; copies.py gathers it).
            what = self._metric_place[id(metric)] if copies else metric

            def weighted(handed: list) -> None:
                _check_same(handed, what)
                dtype = handed[0][1].dtype
                value = tf.add_n([in_dtype(w, dtype) * v for _, v, w in handed])
                before = _read(variables)
                after = metric.stateless_update_state(before, value)
                weight = 1.0 if self.across is None else self.across.weight
                after = [tf.convert_to_tensor(new) for new in after]
                changes = [in_dtype(weight, old.dtype) * (new - old)
                           for new, old in zip(after, before)]  # fmt: skip
                _moved(own, variables, before, changes)

            handed = (what, tf.convert_to_tensor(value), here.weight)
            here.once(handed, weighted, variables)
            return None
        if copies:  # each copy's own, their changes added (copies.py)
            return update(*args, **kwargs)
        after = metric.stateless_update_state(_read(variables), *args, **kwargs)
        after = [tf.convert_to_tensor(a) for a in after]
        forms = [here.form(a, _MARKS, _FORMS) for a in after]

        def added(handed: list) -> None:
            _check_same(handed, metric)
            before = _read(variables)
            changes = _changes([values for _, values, _, _ in handed],
                               [forms for *_, forms in handed], before)  # fmt: skip
            _moved(own, variables, before, changes)

        here.once((metric, after, here.weight, forms), added, variables)
        return None


def _reads(tensor: tf.Tensor, variable: Any) -> bool:
    """Whether ``tensor`` reads ``variable`` (through identities)."""
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    captures = getattr(tf.compat.v1.get_default_graph(), "captures", [])
    handle = {id(o): i for o, i in captures}.get(id(variable.handle), variable.handle)
    return tensor.op.type == "ReadVariableOp" and tensor.op.inputs[0] is handle


def _read(variables: list[Any]) -> list[tf.Tensor]:
    return [tf.convert_to_tensor(v) for v in variables]


def _moved(assign: Any, variables: list, before: list, changes: list) -> None:
    """Each of a metric's ``variables`` moved by its change."""
    with tf.name_scope("metrics/"):
        for variable, old, change in zip(variables, before, changes):
            assign(variable, old + change)


def _same(forms: list[Any]) -> bool:
    """Whether every tower's value has the first's form, one of none of its
    rows and no draw (``state.form_of``)."""
    return forms[0].of is not None and all(f == forms[0] for f in forms)


def _changes(afters: list[list], forms: list[list], before: list) -> list:
    """Each variable's change from every tower's ``afters`` (of ``forms``):
    the first's when every variable's is the same on every tower, else their
    sum."""
    same = all(_same([f[i] for f in forms]) for i in range(len(before)))
    if same:
        return [new - old for new, old in zip(afters[0], before)]
    return [tf.add_n([after[i] - old for after in afters])
            for i, old in enumerate(before)]  # fmt: skip


def alike(values: list[tf.Tensor], corresponding: Any = None) -> bool:
    """Whether every tower's value has the first's form (``state.form_of``):
    the same ops, with the same attributes, on the same captured variables
    (or ``corresponding`` ones: a captured handle's id -> its place in its
    copy) and constants, or on one meeting's results; nothing random.

    >>> x = tf.constant([1.0, 2.0])
    >>> alike([x * 2.0, x * 2.0]), alike([x * 2.0, x * 3.0])
    (True, False)
    """
    if all(v is values[0] for v in values):
        return True
    forms: dict = {}  # shared: a subgraph every tower reads, walked once
    found = [form_of(v, (), _MARKS, corresponding, forms) for v in values]
    return found[0] is not None and all(f == found[0] for f in found)


def _corresponding(models: list[Any]) -> dict[int, int]:
    """In the graph being traced, each captured handle of a copy's variable
    (by id) -> the variable's place in its copy."""
    place = {id(v.value.handle): i for m in models for i, v in enumerate(m.variables)}
    graph = tf.compat.v1.get_default_graph()
    captures = getattr(graph, "captures", [])
    return {id(inner): place[id(outer)] for outer, inner in captures
            if id(outer) in place}  # fmt: skip


def _batch_number(args: tuple, kwargs: dict) -> Any:
    """The one number a metric update was given for the whole batch (a
    scalar, no sample weight), or None for any other update."""
    given = dict(kwargs)
    if given.pop("sample_weight", None) is not None or len(args) > 1:
        return None
    leaves = keras.tree.flatten((args, given))
    if len(leaves) != 1 or len(getattr(leaves[0], "shape", ())) != 0:
        return None
    return leaves[0]


def _every_metric(model: keras.Model) -> list[Any]:
    """The model's metrics and the metrics they hold, outermost first."""
    found, queue = [], list(model.metrics)
    while queue:
        metric = queue.pop(0)
        if any(metric is m for m in found):
            continue
        found.append(metric)
        queue.extend(getattr(metric, "_metrics", []))
    return found


def _check_same(handed: list[tuple], what: Any) -> None:
    """Refuses towers that changed different things at one meeting (``what``
    by identity; with a copy per tower, a variable's place in its copy)."""
    places = isinstance(what, int)
    if any(item[0] != what if places else item[0] is not what for item in handed):
        names = [
            getattr(item[0], "path", None) or getattr(item[0], "name", item[0])
            for item in handed
        ]
        raise ValueError(
            "the towers' own steps assigned different variables or updated "
            f"different metrics at the same point ({names}); a step must "
            "change the same ones on every shard. Nothing was updated."
        )

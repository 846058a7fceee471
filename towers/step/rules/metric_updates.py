"""A model's own step's metric updates, met as its assignments are
(``assignments.py``): a ``keras.metrics.Mean`` given one number for the
batch is updated once with the towers' numbers weighted by their shares;
any other update adds the towers' changes, unless every tower's is the same.
The step's logs that are a metric's ``result()`` are known so (``is_result``).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers._keras import in_stateless_scope
from towers.combine import in_dtype
from towers.step.run.seats import Across, current


def met_for(tensors: list[tf.Tensor], meeting: Any) -> None:
    """Marks ``tensors`` as the result of ``meeting``: the same on every tower."""
    marks = current().marks
    for tensor in tensors:
        marks[tensor.ref()] = meeting


class MetricUpdates:
    """The metric updates and results of the towers' own steps, routed to
    their meetings by :class:`~towers.step.rules.assignments.Assignments`
    (which sets ``models``, ``across``, ``apart``, ``as_mean``, ``_own``
    and ``_metric_place``)."""

    models: list[keras.Model]
    across: Across | None
    apart: bool
    _own: Any
    _metric_place: dict[int, int]

    def __init__(self) -> None:
        # A metric's result() the step read, by its values' ids (when traced).
        self._results: dict[Any, Any] = {}
        self.as_mean: Any = lambda value: value  # Applies.as_mean

    def is_result(self, value: Any) -> bool | None:
        """Whether ``value`` (one the step returns) is a metric's ``result()``;
        None where it cannot be known (copies)."""
        if self.apart or len(self.models) > 1:
            return None
        leaves = tf.nest.flatten(value)
        return bool(leaves) and all(id(leaf) in self._results for leaf in leaves)

    def note(self, value: Any, result: bool | None) -> None:
        """``value``, a log as run, is a metric's result where ``result``."""
        if result:
            self._results[id(value)] = (None, value)

    def _result(self, metric: Any, result: Any, args: tuple, kwargs: dict) -> Any:
        value = result(*args, **kwargs)
        for leaf in tf.nest.flatten(value):
            self._results[id(leaf)] = (metric, leaf)  # kept: its id stays its own
        return value

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
                check_same(handed, what)
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
        forms = [here.form(a) for a in after]

        def added(handed: list) -> None:
            check_same(handed, metric)
            before = _read(variables)
            changes = _changes([values for _, values, _, _ in handed],
                               [forms for *_, forms in handed], before)  # fmt: skip
            _moved(own, variables, before, changes)

        here.once((metric, after, here.weight, forms), added, variables)
        return None


def _read(variables: list[Any]) -> list[tf.Tensor]:
    return [tf.convert_to_tensor(v) for v in variables]


def _moved(assign: Any, variables: list, before: list, changes: list) -> None:
    with tf.name_scope("metrics/"):
        for variable, old, change in zip(variables, before, changes):
            assign(variable, old + change)


def same_form(forms: list[Any]) -> bool:
    # Whether every tower's value has the first's form: no rows, no draw.
    return forms[0].of is not None and all(f == forms[0] for f in forms)


def _changes(afters: list[list], forms: list[list], before: list) -> list:
    # Each variable's change: the first tower's where all are alike, else the sum.
    same = all(same_form([f[i] for f in forms]) for i in range(len(before)))
    if same:
        return [new - old for new, old in zip(afters[0], before)]
    return [tf.add_n([after[i] - old for after in afters])
            for i, old in enumerate(before)]  # fmt: skip


def _batch_number(args: tuple, kwargs: dict) -> Any:
    # The one number a metric update got for the whole batch, or None.
    given = dict(kwargs)
    if given.pop("sample_weight", None) is not None or len(args) > 1:
        return None
    leaves = keras.tree.flatten((args, given))
    if len(leaves) != 1 or len(getattr(leaves[0], "shape", ())) != 0:
        return None
    return leaves[0]


def every_metric(model: keras.Model) -> list[Any]:
    # The model's metrics and those they hold, outermost first.
    found, queue = [], list(model.metrics)
    while queue:
        metric = queue.pop(0)
        if any(metric is m for m in found):
            continue
        found.append(metric)
        queue.extend(getattr(metric, "_metrics", []))
    return found


def check_same(handed: list[tuple], what: Any) -> None:
    # Towers that changed different things at one meeting are refused.
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

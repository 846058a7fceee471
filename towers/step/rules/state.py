"""State a layer or a model's own step assigns, assigned once a step by the
variable's ``aggregation`` (as tf.distribute reads it): the one home of the
rules (:func:`aggregate`), for the built-in step's passes (each tower's
scope keeps what it assigns, ``towers/_keras``'s ``ReadScope``) and a model's
own step (``assignments.py``)::

    "sum"                 v + sum_t (v_t - v)        the towers' changes add up
    "mean"                sum_t n_t v_t / sum_t n_t  a statistic of the batch
    "only_first_replica"  v_0
    "none" (Keras')       v_0 where every tower's value has one form, of none
                          of its rows and no draw (``forms.form_of``); else
                          refused by name

In a cluster the workers' changes meet in the step's sum, "mean" weighted by
their examples; "none" and "only_first_replica" take the chief's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from towers._keras import is_seed_state, layers_of
from towers.combine import in_dtype

RULES = ("sum", "mean", "only_first_replica", "none")


@dataclasses.dataclass
class Settled:
    """A variable the towers assigned, its ``rule``, its value ``before`` the
    step and the ``value`` it takes from this process's towers; ``change`` and
    ``towers``: what this worker adds to a cluster's sums."""

    variable: Any
    rule: str
    before: tf.Tensor
    value: tf.Tensor
    change: tf.Tensor
    towers: tf.Tensor


def rule_of(variable: Any) -> str:
    """A variable's aggregation as one of :data:`RULES` (Keras' or tf.distribute's).

    >>> import keras
    >>> rule_of(keras.Variable(0.0, aggregation="sum")), rule_of(keras.Variable(0.0))
    ('sum', 'none')
    """
    name = str(getattr(variable, "aggregation", "none")).lower()
    name = name.rsplit(".", 1)[-1]  # tf.VariableAggregation.SUM -> "sum"
    return name if name in RULES else "none"


def raw_variables(model: keras.layers.Layer) -> list[tuple[tf.Variable, str]]:
    """The ``tf.Variable``\\ s ``model``'s layers hold, named ``layer/attribute``,
    which ``model.variables`` omits and a model's own step may assign.

    >>> layer = keras.layers.Dense(1, name="head")
    >>> layer.total = tf.Variable(0.0)
    >>> [name for _, name in raw_variables(layer)]
    ['head/total']
    """
    found: dict[int, tuple[tf.Variable, str]] = {}
    for layer in layers_of(model):
        for attribute, value in vars(layer).items():
            if attribute.startswith("_self_"):  # tf.Module's tracking
                continue
            held = list(value.values()) if isinstance(value, dict) else value
            for v in held if isinstance(held, (list, tuple)) else [value]:
                if isinstance(v, tf.Variable) and not isinstance(v, keras.Variable):
                    found.setdefault(id(v), (v, f"{layer.name}/{attribute}"))
    return list(found.values())


def aggregate(rule: str, before: Any, values: list, weights: list) -> tuple:
    """A process's part of a variable its towers assigned ``values``, as
    ``(change, weight)``: it takes ``before + change / weight`` for "mean"
    (``weights``: the towers' examples or shares), ``before + change`` else.

    >>> change, weight = aggregate("mean", 0.0, [1.0, 4.0], [3, 1])
    >>> float(change / weight)  # (3 * 1 + 1 * 4) / 4
    1.75
    """
    before = tf.convert_to_tensor(before)
    if rule == "mean" and not before.dtype.is_floating:
        before = tf.cast(before, tf.float64)
    changes = [tf.cast(v, before.dtype) - before for v in values]
    if rule == "sum":
        return tf.add_n(changes), 1.0
    if rule == "mean":
        weights = [in_dtype(w, before.dtype) for w in weights]
        return tf.add_n([w * c for w, c in zip(weights, changes)]), tf.add_n(weights)
    return changes[0], 1.0


def settle(passes: list[Any], sizes: list[Any], cluster: Any = None) -> list:
    """What each variable the towers' ``passes`` assigned takes this step, in
    the order assigned (``sizes``: their shards' examples; an empty share
    adds nothing).

    Example:
      >>> import keras, types
      >>> count = keras.Variable(1.0, aggregation="sum")
      >>> passes = [types.SimpleNamespace(state=[count], state_values=[v],
      ...           state_forms=[None]) for v in (tf.constant(3.0), tf.constant(4.0))]
      >>> float(settle(passes, [2, 2])[0].value)  # 1 + (3 - 1) + (4 - 1)
      6.0

    Raises:
      ValueError: a variable of aggregation "none" given values of other forms.
    """
    assigned: dict[int, tuple[Any, list, list, list]] = {}
    for tower_pass, size in zip(passes, sizes):
        for variable, value, form in zip(
            tower_pass.state, tower_pass.state_values, tower_pass.state_forms
        ):
            _, values, weights, forms = assigned.setdefault(
                id(variable), (variable, [], [], [])
            )
            values.append(value)
            weights.append(size)
            forms.append(form)
    settled = []
    for variable, values, weights, forms in assigned.values():
        rule = rule_of(variable)
        dtype = variable.dtype if tf.as_dtype(variable.dtype).is_floating else "float32"
        before = tf.convert_to_tensor(variable)
        if len(values) == 1:  # one tower's (or its copy's) value, as it is
            weights = [1.0]
        change, weight = aggregate(rule, before, values, weights)
        value = values[0]  # "none" and "only_first_replica"
        if rule in ("sum", "mean"):
            change = change / weight if rule == "mean" else change
            value = before + tf.cast(change, before.dtype)
        # A seed generator's state: every tower drew from the same start,
        # each its rows of the batch's draw (draws.py): the first's is one
        # device's.
        meets = len(values) > 1 or cluster is not None
        if rule == "none" and meets and not is_seed_state(variable):
            if None in forms or len(set(forms)) > 1:
                raise refused(variable.path, rule)
        change, weight = tf.cast(change, dtype), tf.cast(weight, dtype)
        if rule == "mean":  # what the workers' sums divide: sum_t n_t (v_t - v)
            change = change * weight
        if rule in ("none", "only_first_replica"):
            if cluster is not None and not cluster.is_chief:
                change = tf.zeros_like(change)
        elif cluster is not None:  # an empty share (zeros) adds nothing
            kept = tf.cast(_examples(sizes) > 0, dtype)
            change, weight = change * kept, weight * kept
        value = tf.cast(value, before.dtype)
        settled.append(Settled(variable, rule, before, value, change, weight))
    return settled


def refused(path: str, rule: str) -> ValueError:
    """The error for a variable assigned a value that differs from tower to
    tower, which its aggregation ``rule`` cannot make one device's."""
    return ValueError(
        f"the variable {path!r} is assigned a value that differs from tower "
        f"to tower (aggregation={rule!r}): it reads the tower's rows of the "
        "batch (their values or their number) or a random draw, where one "
        "device would assign it once, from "
        "the whole batch. Create the variable with aggregation='sum' (the "
        "towers' changes add up: a count of examples), 'mean' (their values "
        "weighted by their examples), 'only_first_replica' (the first "
        "tower's), or compute it in a model's own step from the batch's rows "
        "(towers.gather). Nothing was updated."
    )


def _examples(sizes: list[Any]) -> Any:
    if all(isinstance(n, int) for n in sizes):
        return sum(sizes)
    return tf.add_n([tf.cast(n, tf.int64) for n in sizes])


def assign(
    settled: list[Settled], changes: list | None = None, trainable: bool | None = None
) -> None:
    """Assigns each variable its value, or ``before`` plus the cluster's summed
    ``changes``; with ``trainable``, only the variables that are (or are not)."""
    for i, item in enumerate(settled):
        if trainable is not None and bool(item.variable.trainable) != trainable:
            continue
        value = item.value
        if changes is not None:
            change, towers = changes[2 * i], changes[2 * i + 1]
            if item.rule == "mean":
                change = change / towers
            value = item.before + tf.cast(change, item.before.dtype)
        item.variable.assign(tf.cast(value, item.variable.dtype))


def exchanged(settled: list[Settled]) -> list[tf.Tensor]:
    """What this worker adds to the cluster's sum for ``settled``: each
    variable's change and tower count."""
    return [t for item in settled for t in (item.change, item.towers)]


def settle_apart_metrics(
    passes: list[Any], sizes: list[Any], models: list[keras.Model], cluster: Any
) -> list[Settled]:
    """:func:`settle`, the models' metrics' variables assigned at once (a
    cluster sums their changes with the other metrics'); returns the rest."""
    settled = settle(passes, sizes, cluster)
    metric = {id(v) for model in models for m in model.metrics for v in m.variables}
    assign([item for item in settled if id(item.variable) in metric])
    return [item for item in settled if id(item.variable) not in metric]


def describe(rule: str) -> str:
    """What a rule does, in words (``towers explain``).

    >>> describe("sum")
    "aggregation 'sum': the towers' changes add up"
    """
    return (
        f"aggregation {rule!r}: "
        + {
            "sum": "the towers' changes add up",
            "mean": "the towers' values weighted by their examples",
            "only_first_replica": "the first tower's",
            "none": "the towers' one value (refused where it reads their rows)",
        }[rule]
    )


def state_variables(model: keras.layers.Layer) -> list[Any]:
    """``model``'s variables that are not weights: its layers' seed generators'
    states, which a layer assigns as it draws (Dropout in training)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]

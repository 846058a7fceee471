"""State a layer assigns in its forward pass, assigned once a step by the
variable's aggregation.

A layer may assign a variable in ``call``: a counter of the batches it saw, a
metric it updates (in ``call`` or in the model's ``compute_loss``). Left
alone, every tower would assign it in turn, so it would move T times a step.
Instead each tower's pass keeps what it assigns in its scope (every tower
starts from the value before the step: ``towers/_keras``'s ``ReadScope``),
and the step assigns each such variable once, as its ``aggregation`` says, the
way tf.distribute reads it::

    "sum"                 v0 + sum_t (v_t - v0)   the towers' changes add up
                                                  (Keras' metrics' variables)
    "mean"                mean_t v_t
    "only_first_replica"  v_0                     the first working tower's
    "none" (Keras' default; MirroredStrategy refuses it in a replica)
                          v_0, with a warning naming the variable once: a
                          counter moves once a step, as on one device

BatchNormalization's moving statistics and seed generators' states follow
rules of their own (``towers/step/batchnorm.py``, ``towers/step/draws.py``). A
copy of the model per tower (the replicated and independent placements)
assigns each copy its own tower's value. In a cluster the workers' changes
meet in the step's sum: "sum" adds every worker's, "mean" averages over every
worker's towers, and "none" and "only_first_replica" take the chief's.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import tensorflow as tf

from towers._keras import is_seed_state

RULES = ("sum", "mean", "only_first_replica", "none")


@dataclasses.dataclass
class Settled:
    """A variable the towers assigned, and what it takes this step.

    Attributes:
      variable: the variable.
      rule: its aggregation, one of :data:`RULES`.
      before: its value before the step.
      value: what it takes, from this process's towers.
      change: what this worker adds to the cluster's sum (in the variable's
        float dtype, float32 for another): ``value - before``, or for "none"
        and "only_first_replica" that on the chief and zeros elsewhere.
      towers: how many towers assigned it (a "mean" divides by every
        worker's, summed).
    """

    variable: Any
    rule: str
    before: tf.Tensor
    value: tf.Tensor
    change: tf.Tensor
    towers: tf.Tensor


def rule_of(variable: Any) -> str:
    """A variable's aggregation as one of :data:`RULES` (Keras' names, or
    tf.distribute's).

    >>> import keras
    >>> rule_of(keras.Variable(0.0, aggregation="sum")), rule_of(keras.Variable(0.0))
    ('sum', 'none')
    """
    name = str(getattr(variable, "aggregation", "none")).lower()
    name = name.rsplit(".", 1)[-1]  # tf.VariableAggregation.SUM -> "sum"
    return name if name in RULES else "none"


def settle(
    passes: list[Any],
    cluster: Any = None,
    warned: set | None = None,
    empty: Any = False,
) -> list:
    """What each variable the towers' ``passes`` assigned takes this step.

    Args:
      passes: the working towers' passes, in tower order, each with ``state``
        (the variables it assigned) and ``state_values`` (their values after it).
      cluster: the ``towers.Cluster`` this process is a worker of, or None.
      warned: the paths already warned of (the warning is once a variable).
      empty: whether this worker's share of the batch is empty (its tower
        ran on zeros): it adds nothing to a "sum" or "mean".

    Returns:
      A :class:`Settled` per variable, in the order the towers assigned them.

    Example:
      >>> import keras, types
      >>> count = keras.Variable(1.0, aggregation="sum")
      >>> passes = [types.SimpleNamespace(state=[count], state_values=[v])
      ...           for v in (tf.constant(3.0), tf.constant(4.0))]
      >>> float(settle(passes)[0].value)  # 1 + (3 - 1) + (4 - 1)
      6.0
    """
    warned = set() if warned is None else warned
    assigned: dict[int, tuple[Any, list]] = {}
    for tower_pass in passes:
        for variable, value in zip(tower_pass.state, tower_pass.state_values):
            assigned.setdefault(id(variable), (variable, []))[1].append(value)
    settled = []
    for variable, values in assigned.values():
        rule = rule_of(variable)
        before = tf.convert_to_tensor(variable)
        if len(values) == 1:
            value = values[0]
        elif rule == "sum":
            value = before + tf.add_n([v - before for v in values])
        elif rule == "mean":
            value = tf.add_n(values) / len(values)
        else:
            value = values[0]
        shared = len(values) > 1 or cluster is not None
        # A seed generator's state: every tower drew from the same start,
        # each its rows of the batch's draw (draws.py): the first's is one
        # device's, no warning due.
        quiet = variable.path in warned or is_seed_state(variable)
        if rule == "none" and shared and not quiet:
            warned.add(variable.path)
            warnings.warn(_none_warning(variable.path), stacklevel=6)
        dtype = variable.dtype if tf.as_dtype(variable.dtype).is_floating else "float32"
        change = tf.cast(value - before, dtype)
        towers = tf.constant(float(len(values)), dtype)
        if rule == "mean":
            change = tf.cast(tf.add_n([v - before for v in values]), dtype)
        if rule in ("none", "only_first_replica"):
            if cluster is not None and not cluster.is_chief:
                change = tf.zeros_like(change)
        else:
            kept = 1.0 - tf.cast(empty, dtype)  # an empty share adds nothing
            change, towers = change * kept, towers * kept
        settled.append(Settled(variable, rule, before, value, change, towers))
    return settled


def assign(settled: list[Settled], changes: list | None = None) -> None:
    """Assigns each variable its value: this process's (``changes`` None), or
    ``before`` plus the cluster's summed ``changes`` (``[change, towers]`` per
    variable, as :func:`exchanged` sends them)."""
    for i, item in enumerate(settled):
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
    passes: list[Any], models: list[Any], cluster: Any, warned: set, empty: Any
) -> list[Settled]:
    """:func:`settle`, a metric's variables (the models' own metrics, updated
    in ``call`` or ``compute_loss``) assigned at once: in a cluster the
    metrics' changes are summed with the other metrics'. Returns the rest."""
    settled = settle(passes, cluster, warned, empty)
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
            "mean": "the towers' values averaged",
            "only_first_replica": "the first tower's",
            "none": "the first tower's (warned of)",
        }[rule]
    )


def _none_warning(path: str) -> str:
    return (
        f"towers: the variable {path!r} is assigned in the forward pass and "
        "has aggregation='none', so of the towers' assignments the first "
        "tower's is kept: it moves once a step, as on one device. Create "
        "it with aggregation='sum' to add up the towers' changes (a count of "
        "examples), 'mean' to average them, or 'only_first_replica' to keep the "
        "first tower's without this warning."
    )


def state_variables(model: Any) -> list[Any]:
    """``model``'s variables that are not weights: its layers' seed generators'
    states, which a layer assigns as it draws (Dropout in training)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]

"""A model's own ``train_step`` with a copy of the model per tower
(``placement="replicated"`` or ``"independent"``, ``towers/placement/replicas.py``).

Each tower runs its own copy's step, and each apply in it is still where the
towers meet (``towers/step/custom.py``), but every tower applies to its own
copy with its copy's own optimizer:

- replicated: the first tower all-reduces every tower's gradients, each
  weighted by its share of the examples (``n_t / B``; 1 with
  ``own_step_loss="sum"``), on TensorFlow's collective runtime, and every
  tower applies the sum. The copies stay identical, each step one device's.
- independent: each tower applies its own gradients, nothing exchanged (the
  zero-sync floor of a custom step).

The metrics each copy's step updates are gathered into copy 0's (the
engine's ``model``, whose metrics fit reports): before the step every copy's
metric variables are set to copy 0's, after it copy 0 takes every copy's
change.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers._keras import build_compiled_metrics, compiled_metrics_unbuilt
from towers.combine import combine_gradients

# Instance keys of one apply's all-reduce: each apply of a step takes its own
# range (the shapes differ from apply to apply).
INSTANCES_PER_APPLY = 1000


def apply_each(placement: Any, seat: Any, handed: list, apply: Any, number: int) -> Any:
    """The apply of ``seat``'s tower to its copy's variables (what it handed
    in, with every tower's ``handed``), its ``number``-th in the step."""
    rank = seat.rank
    _, variables, grads, _ = handed[rank]
    if placement.name == "replicated":
        sums = seat.from_first(lambda: _all_reduced(placement, handed, number))
        grads = sums[rank]
    with tf.device(placement.devices[rank]), tf.name_scope("apply/"):
        return apply(grads, variables)


def check_same(handed: list[tuple], copies: bool = False) -> None:
    """Refuses towers that met at different applies (another optimizer, or
    other variables; with a copy per tower, another kind or shapes), naming
    the two."""
    optimizer, variables, *_ = handed[0]
    for other, (theirs, their_variables, *_) in enumerate(handed[1:], start=1):
        key = (lambda v: v.shape) if copies else id
        same = [key(v) for v in their_variables] == [key(v) for v in variables]
        same = same and (
            type(theirs) is type(optimizer) if copies else theirs is optimizer
        )
        if not same:
            raise ValueError(
                "the towers' train_step reached different applies: tower 0 "
                f"applied {optimizer.name} to {len(variables)} variables, tower "
                f"{other} {theirs.name} to {len(their_variables)}. A step must "
                "make the same applies on every shard; nothing was updated."
            )


def _all_reduced(placement: Any, handed: list, number: int) -> list[list]:
    """Every tower's gradients weighted by its share and all-reduced by the
    placement (``Replicated.combine``): per tower, the sums (None where no
    tower has a gradient)."""
    weighted = []
    for t, (_, _, grads, share) in enumerate(handed):
        with tf.device(placement.devices[t]):
            weighted.append(
                combine_gradients([list(grads)], weights=[share], reduction="sum")
            )
    variables = [variables for _, variables, _, _ in handed]
    with tf.name_scope("all_reduce/"):
        return placement.combine(weighted, variables, number * INSTANCES_PER_APPLY)


def build_copies(placement: Any, x: Any, y: Any = None, sample_weight: Any = None):
    """Builds every other copy's compiled metrics from the batch's shapes as
    copy 0's are built, so their variables line up."""
    for t, model in enumerate(placement.models[1:], start=1):
        if compiled_metrics_unbuilt(model):
            with tf.device(placement.devices[t]):
                build_compiled_metrics(model, (x, y, sample_weight))


def level_metrics(models: list[keras.Model]) -> list[tf.Tensor]:
    """Sets every copy's metric variables to copy 0's; returns those values."""
    first, *others = [metric_variables(model) for model in models]
    before = [tf.identity(v) for v in first]
    for variables in others:
        for variable, value in zip(variables, before, strict=True):
            variable.assign(value)
    return before


def gather_metrics(models: list[keras.Model], before: list[tf.Tensor]) -> None:
    """Adds every other copy's change of its metrics since ``before`` to
    copy 0's."""
    first, *others = [metric_variables(model) for model in models]
    for variable, value, *theirs in zip(first, before, *others, strict=True):
        variable.assign_add(tf.add_n([v - value for v in theirs]))


def metric_variables(model: keras.Model) -> list[Any]:
    """The variables of ``model``'s metrics, in order."""
    return [v for metric in model.metrics for v in metric.variables]

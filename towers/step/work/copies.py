"""A model's own ``train_step`` with a copy of the model per tower
(``placement="replicated"`` or ``"independent"``, ``towers/placement/replicas.py``):
the copies' metrics.

Each tower runs its own copy's step and applies to its own copy
(``towers/step/work/applies.py``). The metrics each copy's step updates are
gathered into copy 0's (the engine's ``model``, whose metrics fit reports):
before the step every copy's metric variables are set to copy 0's, after it
copy 0 takes every copy's change.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers._keras import build_compiled_metrics, compiled_metrics_unbuilt
from towers.placement.base import Placement


def build_copies(
    placement: Placement, x: Any, y: Any = None, sample_weight: Any = None
):
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

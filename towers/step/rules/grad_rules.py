"""The towers' gradients as one device's where adding them up is not, set
right before the placement's combine: each such case is a rule of its own
(a file in ``rules/``, listed in :data:`RULES`), given a variable's towers'
gradients, that returns one device's gradient or None where it does not
apply.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.placement.base import Placement
from towers.step.rules import float8, row_slices
from towers.step.rules.forms import Reads

# Each rule: (variable, its towers' gradients, whether a tensor reads the
# batch) -> one device's gradient, or None. The first that applies wins.
RULES = (float8.one_devices, row_slices.one_devices)


def as_one_devices(
    tower_grads: list[list[Any]], variables: list[Any], batch: Any
) -> list[list[Any]]:
    """``tower_grads[t][v]`` where a rule applies as one device has it:
    tower 0's, the others None (which the combine passes by)."""
    reads = Reads(batch, shapes=False)  # an eager tensor: by assumption
    out = [list(grads) for grads in tower_grads]
    for v, variable in enumerate(variables):
        grads = [grads[v] for grads in tower_grads]
        if len(grads) < 2:
            continue
        for rule in RULES:
            one = rule(variable, grads, reads)
            if one is not None:
                out[0][v] = one
                for t in range(1, len(out)):
                    out[t][v] = None
                break
    return out


def combined(
    placement: Placement,
    tower_grads: list[list[Any]],
    batch: Any,
    variables: Any = None,
) -> list[Any]:
    """``tower_grads[t][v]`` (of ``variables``, the trainable ones by default)
    combined by the placement, each kind above one device's first: the one
    combine of the built-in step and of each apply of a model's own."""
    if len(placement.models) > 1:  # a copy per tower: each its own
        return placement.combine(tower_grads) if tower_grads[0] else tower_grads
    if not tower_grads[0]:  # a model without trainable variables
        return []
    if batch is not None:
        listed = placement.model.trainable_variables if variables is None else variables
        with tf.device(placement.variable_device), tf.name_scope("combine"):
            tower_grads = as_one_devices(tower_grads, listed, batch)
    return placement.combine(tower_grads, variables)

"""An optimizer's non-public parts towers uses: the variables it applies
to (``_trainable_variables``), and its build run again for variables it was
not built with. Keras' fit builds an optimizer for the variables trainable
at its first step and has no call to add one later (its fit needs a new
optimizer); towers builds it as Keras does, and on for a layer unfrozen
later, each slot list joined to the one it holds.
"""

from __future__ import annotations

from typing import Any


def build_optimizer(optimizer: Any, variables: list[Any]) -> list[Any]:
    """Builds ``optimizer`` for ``variables`` (the model's trainable ones),
    as Keras' fit builds it; built already, its build runs for those it was
    not built with (a layer unfrozen since), each slot list of theirs joined
    to the one it holds (Keras has no call for it: its fit needs a new
    optimizer there). Returns the variables it made."""
    if not optimizer.built:
        made = len(optimizer.variables)
        optimizer.build(list(variables))
        return optimizer.variables[made:]
    known = optimizer._trainable_variables_indices
    extra = [v for v in variables if optimizer._var_key(v) not in known]
    if not extra:
        return []
    old, before = list(optimizer._trainable_variables), dict(vars(optimizer))
    made = len(optimizer.variables)
    optimizer.built = False
    optimizer.build(extra)
    for name, value in list(vars(optimizer).items()):
        was = before.get(name)
        if was is not value and isinstance(was, list) and len(was) == len(old):
            if name != "_trainable_variables" and len(value) == len(extra):
                # Untracked, as its build sets them: its store holds the slots.
                object.__setattr__(optimizer, name, [*was, *value])
    object.__setattr__(optimizer, "_trainable_variables", [*old, *extra])
    for i, variable in enumerate(optimizer._trainable_variables):
        known[optimizer._var_key(variable)] = i
    return optimizer.variables[made:]


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The variables a built optimizer applies to when ``apply`` is given
    none (Keras keeps them privately)."""
    return list(optimizer._trainable_variables)

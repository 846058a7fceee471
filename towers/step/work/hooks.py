"""Which of Keras' step hooks a model overrides, and what towers runs with
them: the steps that are the model's own (``towers/step/work/own.py``), and
the options refused before any step.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import keras

from towers import _runtime
from towers.placement.base import Placement
from towers.step.run import xla

_PACKAGE = os.path.dirname(os.path.abspath(_runtime.__file__)) + os.sep  # towers/

# The hooks a model overrides that make towers run Keras' steps.
HOOKS = ("train_step", "test_step", "predict_step", "compute_metrics")


def overrides(model: keras.Model, name: str) -> bool:
    """Whether ``model``'s class overrides Keras' ``Model.<name>`` (a hook).

    >>> class Own(keras.Model):
    ...     def compute_loss(self, *args, **kwargs):
    ...         return super().compute_loss(*args, **kwargs)
    >>> overrides(Own(), "compute_loss"), overrides(keras.Sequential(), "compute_loss")
    (True, False)
    """
    return getattr(type(model), name, None) is not getattr(keras.Model, name)


def raised_in_towers(error: BaseException) -> bool:
    """Whether ``error`` was raised in towers' own code (a refusal by name),
    not in the model's hooks, Keras' or TensorFlow's.

    >>> from towers.split import split_batch
    >>> try:
    ...     split_batch([1.0, 2.0], 0)
    ... except ValueError as error:
    ...     raised_in_towers(error), raised_in_towers(ValueError("not raised"))
    (True, False)
    """
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def own_hook(model: keras.Model, name: str) -> Any:
    """``model.<name>``, the model's own step; one it made an XLA
    ``tf.function`` is its Python function, traced in each tower's step
    (whose variables live on the variable device), said once."""
    hook = getattr(model, name)
    body = _runtime.xla_body(hook)
    if body is None:
        return hook
    warnings.warn(  # once: Python's filter shows a warning once a place
        f"{type(model).__name__}.{name} is a tf.function(jit_compile=True): "
        "on towers it runs without XLA, traced in each tower's step, whose "
        "variables live on the variable device (one XLA computation reads "
        "only its own device's).",
        stacklevel=2,
    )
    return body


def custom_hooks(model: keras.Model) -> list[str]:
    """The Keras step hooks ``model`` overrides (``HOOKS``)."""
    return [hook for hook in HOOKS if overrides(model, hook)]


def kinds_of(hooks: list[str]) -> frozenset[str]:
    """The steps (``"train"``, ``"evaluate"``, ``"predict"``) that run Keras'
    own for a model overriding ``hooks``; the others are towers' own, which
    are Keras' defaults (``compute_metrics`` is called by Keras' train and
    test steps)."""
    steps = {"train_step": "train", "test_step": "evaluate", "predict_step": "predict"}
    kinds = {steps[hook] for hook in hooks if hook in steps}
    if "compute_metrics" in hooks:
        kinds |= {"train", "evaluate"}
    return frozenset(kinds)


def refuse_with_hooks(
    hooks: list[str],
    placement: Placement,
    options: dict[str, Any],
    jit: Any,
) -> None:
    """Refuses, by name and before any step, what a model's own steps cannot
    run with yet; warns that an XLA step ``"auto"`` chose runs without XLA.

    Raises:
      ValueError: with the model's own train step, ``jit_compile=True``; with
        a copy per tower, micro-batches or a non-finite policy.
    """
    model = type(placement.model).__name__
    if "train" not in kinds_of(hooks):  # evaluation or prediction alone
        jit = xla.OFF  # nothing trains in them
        options = {"accumulate_steps": 1, "on_nonfinite": "ignore"}
    copies = f"placement={placement.name!r}" if len(placement.models) > 1 else ""
    refused = [
        (copies and options["accumulate_steps"] > 1, "accumulate_steps="
         f"{options['accumulate_steps']} with {copies}", "each copy's optimizer "
         "is built before the first step; use placement='central'"),
        (copies and options["on_nonfinite"] != "ignore", "on_nonfinite="
         f"{options['on_nonfinite']!r} with {copies}", "each copy applies its "
         "own; use placement='central'"),
        (jit.enabled and jit.strict and not jit.compiled, "jit_compile=True",
         "each tower's step stops at its applies; pass jit_compile=False"),
    ]  # fmt: skip
    for refuse, what, why in refused:
        if refuse:
            raise ValueError(
                f"a {model} that overrides {', '.join(hooks)} runs on every "
                f"tower, meeting at its applies; received {what}: {why}."
            )
    if jit.enabled:
        chose = "its compile's jit_compile=True" if jit.compiled else (
            "jit_compile='auto' chose XLA")  # fmt: skip
        warnings.warn(
            f"a {model} that overrides {', '.join(hooks)} runs without XLA "
            f"({chose}): each tower's step stops at its applies.",
            stacklevel=2,
        )

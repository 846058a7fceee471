"""The model compiled with what the engine trains it with.

Keras' ``fit`` trains a compiled model, and the compiled model owns what fit
reports through: its loss tracker, its compiled metrics, a loss tracker per
output (``towers/step/metrics.py``). So towers trains a compiled model too:

- a model compiled by the user keeps its compile: its own objects (custom
  metrics included) are the ones updated;
- a model that was not compiled, given ``loss`` and ``optimizer`` (and
  ``metrics``...) to ``Towers``, is compiled with them, as a Keras user
  compiles before fit;
- what is passed to ``Towers`` explicitly wins over a model's compile: the
  model is compiled again with it and the rest of what its compile was given
  (the same objects);
- a model that was not compiled, given neither, is not: it predicts, and
  ``fit`` and ``evaluate`` ask for a compile, as Keras' do.

The compile is Keras' own ``Model.compile`` (a model that overrides
``compile`` has it bypassed here), run under the variable device so the loss
tracker lives there, with towers' optimizer (already wrapped for loss scaling)
and its resolved ``jit_compile``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers._keras import compile_arguments


class FromCompile:
    """The default of ``Towers``' loss and optimizer: what ``model.compile``
    said (a model that was not compiled must be given them to train)."""

    def __repr__(self) -> str:
        return "<from model.compile>"


FROM_COMPILE = FromCompile()

# Towers' options that model.compile takes too; None: the model's own.
COMPILE_OPTIONS = ("loss_weights", "metrics", "weighted_metrics", "steps_per_execution")


def compile_model(
    models: list[keras.Model],
    optimizers: list[Any],
    loss: Any,
    options: dict[str, Any],
    jit_compile: bool,
    device: str,
) -> None:
    """Compiles the engine's model (``models[0]``) with what it trains with,
    unless its own compile already says so; a copy per tower (``models[1:]``)
    with its optimizer and the loss, its metrics left to copy 0.

    Args:
      models, optimizers: the placement's, in tower order.
      loss: the loss the engine trains (explicit, or the model's own).
      options: ``Towers``' options; those of :data:`COMPILE_OPTIONS` that are
        not None win over the model's compile.
      jit_compile: the engine's resolved choice.
      device: the variable device.
    """
    model = models[0]
    per_execution = options.get("steps_per_execution")
    if per_execution is not None and (
        isinstance(per_execution, bool)
        or not isinstance(per_execution, int)
        or per_execution < 1
    ):
        raise ValueError(
            "steps_per_execution must be a positive integer; received "
            f"steps_per_execution={per_execution!r}"
        )
    given = compile_arguments(model)
    explicit = {name: options.get(name) for name in COMPILE_OPTIONS}
    explicit = {name: value for name, value in explicit.items() if value is not None}
    if given and not explicit and loss is given.get("loss"):
        return  # its own compile: its own objects
    arguments = {
        **{name: given.get(name) for name in COMPILE_OPTIONS},
        "steps_per_execution": given.get("steps_per_execution", 1),
        **explicit,
    }
    with tf.device(device):
        keras.Model.compile(
            model,
            optimizer=optimizers[0],
            loss=loss,
            jit_compile=jit_compile,
            **arguments,
        )
        for copy, optimizer in zip(models[1:], optimizers[1:]):
            keras.Model.compile(
                copy,
                optimizer=optimizer,
                loss=loss,
                loss_weights=arguments["loss_weights"],
                jit_compile=jit_compile,
            )


def given(value: Any, compiled: dict[str, Any], name: str) -> Any:
    """An explicit argument, else the model's compile's; FROM_COMPILE when
    neither says."""
    if value is not FROM_COMPILE:
        return value
    return compiled.get(name, FROM_COMPILE)


def option(options: dict[str, Any], compiled: dict[str, Any], name: str) -> Any:
    """An explicit option, else the compiled model's."""
    value = options.get(name)
    return value if value is not None else compiled.get(name)


def require_compiled(model: keras.Model, call: str) -> None:
    """Raises what Keras' ``fit`` and ``evaluate`` raise for a model that was
    not compiled, saying what towers takes instead.

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> require_compiled(model, "Towers.fit")
    Traceback (most recent call last):
    ...
    ValueError: Towers.fit needs a loss and an optimizer; received a model ...
    """
    if not model.compiled:
        raise ValueError(
            f"{call} needs a loss and an optimizer; received a model that was "
            "not compiled and neither. Call model.compile(optimizer=..., "
            "loss=...) before Towers, or pass loss= and optimizer= to Towers "
            "(predict needs neither)."
        )

"""The step's phases as ``tf.function``s, and what a failed XLA compile does.

The engine calls its step through :class:`Compiled`: the train step traced
for the model's trainable variables, the evaluation and predict steps. When
a tower's XLA computation does not compile (``towers/step/xla.py``), the first call
fails before any update: with ``jit_compile=True`` the error names the layer;
resolved from ``"auto"``, a warning names it and the step is traced anew
without XLA, and the call runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.step import xla
from towers.step.step import Step


def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a ``tf.function`` without AutoGraph, as Keras' own fit traces
    its step. The step's Python makes no decision on a tensor's value (it calls
    ``tf.cond`` where it needs one), and AutoGraph's rewrite of every function
    the step calls, Keras' layers included, was most of the time to trace:
    7.7 s of 11.4 s for MobileNetV2 on one tower."""
    return tf.function(fn, autograph=False)


class Compiled:
    """A step's phases as ``tf.function``s. The train step is traced for the
    variables the model trains: a change of ``trainable`` between steps (which
    tf.function would not see) traces it anew, and copies follow copy 0."""

    def __init__(self, step: Step):
        self.step = step
        self.evaluate = traced(step.evaluate)
        self.predict = traced(step.predict)
        self._train, self._trainable, self._retired = None, None, 0

    def train(self) -> Callable[..., Any]:
        """The compiled train step for the model's trainable variables now."""
        model = self.step.placement.model
        trainable = tuple(id(v) for v in model.trainable_variables)
        if trainable != self._trainable:
            self.step.placement.follow_trainable()
            self._retired = self.train_traces
            self._train, self._trainable = traced(self.step.train), trainable
        return self._train

    @property
    def train_traces(self) -> int:
        """How many times the train step has been traced, retraces included."""
        current = self._train.experimental_get_tracing_count() if self._train else 0
        return self._retired + current

    def run(self, kind: str, call: Callable[..., Any], *batch: Any) -> Any:
        """``call(function, *batch)``, the function being the compiled
        ``kind``: ``"train"``, ``"evaluate"`` or ``"predict"``.

        Raises:
          ValueError: with ``jit_compile=True``, XLA could not compile a
            tower's pass; the error names the layer. Nothing was updated.
        """
        try:
            return call(self._function(kind), *batch)
        except tf.errors.InvalidArgumentError as error:
            tower = self.step.tower
            tower.jit = xla.after_failure(tower.jit, error, self.step.placement.model)
        self._retired = self.train_traces
        self._train, self._trainable = None, None
        self.evaluate, self.predict = (
            traced(self.step.evaluate),
            traced(self.step.predict),
        )
        return call(self._function(kind), *batch)

    def _function(self, kind: str) -> Callable[..., Any]:
        return self.train() if kind == "train" else getattr(self, kind)

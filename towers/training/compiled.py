"""The step's phases as ``tf.function``s, and what a failed XLA compile does.

The engine calls its step through :class:`Compiled`: the train step traced
for the model's trainable variables, the evaluation and predict steps. When
a tower's XLA computation does not compile (``towers/step/run/xla.py``), the first call
fails before any update: with ``jit_compile=True`` the error names the layer;
resolved from ``"auto"``, a warning names it and the step is traced anew
without XLA, and the call runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.step.run import xla
from towers.step.run.warm_up import warm_up
from towers.step.step import Step
from towers.step.work.losses import OneValue
from towers.training.executions import any_count, looped, runs, stack, stackable


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
        self.evaluate = traced(self.step.evaluate)
        self.predict = traced(self.step.predict)
        self._train, self._trainable, self._retired = None, None, 0
        self._train_steps = None
        self._seen: set[tuple] = set()  # (function, alone, batch signature)

    def train(self) -> Callable[..., Any]:
        """The compiled train step for the model's trainable variables now."""
        model = self.step.placement.model
        trainable = tuple(id(v) for v in model.trainable_variables)
        if trainable != self._trainable:
            self.step.placement.follow_trainable()
            if self._trainable is not None and self.step.started:
                self.step.placement.build_slots()  # a layer unfrozen: its slots
            self._retired = self.train_traces
            self._train = traced(self.step.train)
            self._trainable = trainable
            self._train_steps = traced(looped(self.step.train))
            self._loops = any_count(self._train_steps)
        return self._train

    def train_steps(self) -> Callable[..., Any]:
        """The compiled loop of train steps over a stacked run of batches
        (``towers/training/executions.py``), for the trainable variables now:
        traced once per shape of batch, whatever the run's length."""
        self.train()
        return self._loops

    def traces_anew(self, batches: list[tuple]) -> bool:
        """Whether training on prepared ``batches`` traces the train step
        anew (a new signature, or new trainable variables); traced here if
        so, not run. A trace that fails counts as new (the run says why)."""
        before = self.train_traces
        try:
            for run in runs(batches):
                alone = len(batches) == 1 or not stackable(run[0])
                function = self.train() if alone else self.train_steps()
                key = (id(function), alone, _signature(run[0]))
                if key in self._seen:  # a trace looked up costs 3 % of a step
                    continue
                if alone:
                    function.get_concrete_function(*run[0])
                else:
                    function.traced(*stack(run))
                self._seen.add(key)
        except Exception:  # noqa: BLE001 - the checked run traces it again
            return True
        return self.train_traces > before

    @property
    def train_traces(self) -> int:
        """How many times the train step has been traced (alone, or in a loop
        of steps), retraces included."""
        current = sum(
            f.experimental_get_tracing_count()
            for f in (self._train, self._train_steps)
            if f is not None
        )
        return self._retired + current

    def run(self, kind: str, call: Callable[..., Any], *batch: Any) -> Any:
        """``call(function, *batch)``, the function being the compiled
        ``kind``: ``"train"``, ``"train_steps"``, ``"evaluate"`` or
        ``"predict"``.

        Raises:
          ValueError: with ``jit_compile=True``, XLA could not compile a
            tower's pass; the error names the layer. Nothing was updated.
        """
        try:
            function = self._function(kind)
            if self.step.builtin.jit.enabled:
                warm_up(function, *batch)  # one compilation per shard shape
            return call(function, *batch)
        except OneValue:  # raised while traced: Keras' compute_loss instead
            one = (
                batch
                if kind != "train_steps"
                else tf.nest.map_structure(lambda stacked: stacked[0], batch)
            )
            if not self.step.whole_batch_loss(*one):
                raise
        except tf.errors.InvalidArgumentError as error:
            tower = self.step.builtin
            tower.jit = xla.after_failure(tower.jit, error, self.step.placement.model)
        self._retired = self.train_traces
        self._train, self._trainable, self._train_steps = None, None, None
        self.evaluate = traced(self.step.evaluate)
        self.predict = traced(self.step.predict)
        return call(self._function(kind), *batch)

    def train_on(self, batches: list[tuple], call: Callable[..., Any]) -> dict:
        """Trains on prepared ``batches``, in order: consecutive ones of one
        shape in one call of :meth:`train_steps` (``call(function, *batch)``
        runs each), a sparse or ragged one alone, and one batch as one step.
        Returns the last call's output.

        Raises:
          FloatingPointError: with ``on_nonfinite="raise"``, a combined
            gradient was not finite; the steps after it did not run.
        """
        for run in runs(batches):
            if len(batches) == 1 or not stackable(run[0]):
                out = self.run("train", call, *run[0])
            else:
                out = self.run("train_steps", call, *stack(run))
            self._finish(out)
        return out

    def _finish(self, out: dict[str, Any]) -> None:
        """After a training call: raises for a gradient that was not finite
        (``on_nonfinite="raise"``); notes a cluster's stop notice (read by
        fit: ``towers/training/preemption.py``)."""
        if "finite" in out:
            self.step.update.raise_if_nonfinite(out["finite"], out["logs"]["loss"])
        if "stop" in out:
            self.step.workers.last_stop = out["stop"]

    def _function(self, kind: str) -> Callable[..., Any]:
        if kind in ("train", "train_steps"):
            return getattr(self, kind)()
        return getattr(self, kind)


def _signature(batch: tuple) -> str:
    """What a trace of a step on ``batch`` is keyed by: each leaf's type,
    shape and dtype."""
    return repr(
        [
            None if a is None else (type(a).__name__, tuple(a.shape), a.dtype.name)
            for a in tf.nest.flatten(batch, expand_composites=False)
        ]
    )

"""The model's own ``train_step`` on one device: the reference towers' first
step is checked against (``check.py``).

On the whole batch, on the variable device, in one ``tf.function`` as
Keras' fit traces its step; each variable's gradient kept at its apply (the
noise floor of the comparison), and the graph's stateful TensorFlow random
ops listed (a second run would draw anew: nothing to compare).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import GlobalSeed
from towers._keras.optimizers import optimizer_variables
from towers._keras.patches import routed_applies
from towers.step.work.hooks import own_hook

# Stateful TensorFlow random ops: a second run draws other numbers.
STATEFUL_DRAWS = frozenset(
    {"RandomUniform", "RandomUniformInt", "RandomStandardNormal",
     "TruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma",
     "RandomPoisson", "RandomPoissonV2", "RandomCrop"}
)  # fmt: skip


class OneDevice:
    """The model's own ``train_step`` on each of ``batches`` (``(x, y,
    sample_weight)``), in order, on ``device``, run by :meth:`run`.

    Eagerly, a fifth of a trace's time (MobileNetV2: 0.8 s against 4.2 s),
    an optimizer not built yet built at its first apply, as Keras' builds
    it, and its new variables' values kept (``built``: what putting the
    step back puts them back to); traced when made with XLA where the
    towers' passes compile (``jit``: XLA draws other random numbers than
    TensorFlow's kernels), where an eager run fails (``unbuilt``: the trace
    builds the optimizers, before anything is kept), or where it runs on
    several batches (an execution of ``steps_per_execution`` steps: one
    trace, called on each, as Keras' loop calls its step).

    Attributes:
      draws: the stateful TensorFlow random ops a traced step holds (a second
        run would draw anew: nothing to compare), by type; an eager step's
        are named by towers' own step (``step/rules/draws.py``).
    """

    def __init__(
        self,
        model: keras.Model,
        batches: list[tuple],
        device: str,
        jit: bool = False,
        unbuilt: bool = False,
    ):
        self._applied: dict[int, Any] = {}  # id(variable) -> its |gradient|
        self.built: list[tuple[Any, np.ndarray]] = []  # (variable, its first value)
        self._data = [keras.utils.pack_x_y_sample_weight(*b) for b in batches]
        self._graph, self._depth, self._device = None, 0, device

        self.traced = jit or unbuilt or len(self._data) > 1

        def step(data: Any) -> tuple:
            self._applied, self._graph = {}, tf.compat.v1.get_default_graph()
            with routed_applies(self._record):  # as towers runs it (no XLA)
                own = functools.partial(own_hook(model, "train_step"), data)
                logs = _apart(own, self._graph, device) if self.traced else own()
            return logs, self._applied

        self._function, self.draws = step, []
        if self.traced:
            with tf.device(device):
                self._function = tf.function(step, autograph=False, jit_compile=jit)
                graphs = [
                    self._function.get_concrete_function(d).graph for d in self._data
                ]
            self.draws = sorted(set().union(*map(_stateful_draws, graphs)))

    def _record(self, optimizer: Any, grads: Any, variables: Any, apply: Any) -> Any:
        """Keeps each variable's ``|gradient|`` at the outermost apply (a loss
        scale's is the inner's scaled: the noise floor is relative), where
        the step's graph holds it (not inside a ``cond``); run eagerly, builds
        an optimizer not built yet, keeping its variables' first values."""
        if variables is not None and not optimizer.built and tf.executing_eagerly():
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(list(variables))  # as its apply would
            self.built += [(v, np.array(v.numpy())) for v in optimizer.variables]
        if self._depth == 0:
            listed = optimizer_variables(optimizer) if variables is None else variables
            for grad, variable in zip(grads, listed):
                if grad is None or not _in(grad, self._graph):
                    continue
                if getattr(variable, "overwrite_with_gradient", False):
                    continue  # a value, not a gradient (float8's scales)
                grad = tf.abs(tf.convert_to_tensor(grad))  # a slice's rows, dense
                kept = self._applied.get(id(variable))
                self._applied[id(variable)] = (
                    grad if kept is None else tf.maximum(kept, grad)
                )
        self._depth += 1
        try:
            return apply(grads, variables)
        finally:
            self._depth -= 1

    def run(self) -> tuple[Any, dict[int, np.ndarray]]:
        """Runs the steps; returns their last logs and ``|gradient|`` by
        ``id(variable)`` (the largest of its applies')."""
        largest: dict[int, np.ndarray] = {}
        with tf.device(self._device):
            for data in self._data:
                logs, grads = self._function(data)
                for key, grad in grads.items():
                    grad = np.asarray(grad, np.float64)
                    largest[key] = np.maximum(largest.get(key, grad), grad)
        return logs, largest


def _apart(step: Any, graph: tf.Graph, device: str) -> Any:
    """``step()`` traced into ``graph`` from a thread of its own, as towers
    traces its towers: ``tf.function`` traces again a function whose first
    trace made variables (an optimizer's slots at its first apply, which
    Keras makes out of the graph), as it sees them with the variable creator
    stack of the thread that traces it: one trace, not Keras' fit's two.
    Keras' global seed generator is the caller's."""
    out: list[Any] = []
    errors: list[BaseException] = []
    seed = GlobalSeed(device)

    def trace() -> None:
        try:
            with seed.in_thread(), graph.as_default(), tf.device(device):
                out.append(step())
        except BaseException as error:  # noqa: BLE001 - raised in the caller
            errors.append(error)

    thread = threading.Thread(target=trace, name="one-device-trace")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    seed.kept()
    return out[0]


def _in(tensor: Any, graph: Any) -> bool:
    """Whether ``tensor`` is the step's own: eager, or of its graph (not of a
    ``cond`` branch's, which the step cannot return)."""
    return tf.executing_eagerly() or getattr(tensor, "graph", None) is graph


def _stateful_draws(graph: tf.Graph) -> set[str]:
    found = {op.type for op in graph.get_operations() if op.type in STATEFUL_DRAWS}
    for function in graph.as_graph_def().library.function:
        found |= {n.op for n in function.node_def if n.op in STATEFUL_DRAWS}
    return found

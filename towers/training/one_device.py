"""The model's own ``train_step`` on one device: the reference towers' first
step is checked against (``check.py``).

On the whole batch, on the variable device, in one ``tf.function`` as
Keras' fit traces its step; each variable's gradient kept at its apply (the
noise floor of the comparison), and the graph's stateful TensorFlow random
ops listed (a second run would draw anew: nothing to compare).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import optimizer_variables
from towers._keras.patches import routed_applies

# Stateful TensorFlow random ops: a second run draws other numbers.
STATEFUL_DRAWS = frozenset(
    {"RandomUniform", "RandomUniformInt", "RandomStandardNormal",
     "TruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma",
     "RandomPoisson", "RandomPoissonV2", "RandomCrop"}
)  # fmt: skip


class OneDevice:
    """The model's own ``train_step`` on each of ``batches`` (``(x, y,
    sample_weight)``), in order, in one ``tf.function`` on ``device`` (with
    XLA if ``jit``, as Keras' fit compiles it where the towers' passes do:
    XLA draws other random numbers than TensorFlow's kernels):
    traced when made (an optimizer a custom step builds at its first apply
    is built then, as towers' step would build it), run by :meth:`run`.

    Attributes:
      draws: the stateful TensorFlow random ops its graph holds (a second
        run would draw anew: nothing to compare), by type.
    """

    def __init__(
        self, model: keras.Model, batches: list[tuple], device: str, jit: bool = False
    ):
        self._applied: dict[int, Any] = {}  # id(variable) -> its |gradient|
        self._data = [keras.utils.pack_x_y_sample_weight(*b) for b in batches]
        self._graph, self._depth = None, 0

        def steps(data: list) -> tuple:
            self._applied, self._graph = {}, tf.compat.v1.get_default_graph()
            with routed_applies(self._record):
                logs = [model.train_step(d) for d in data][-1]
            return logs, self._applied

        with tf.device(device):
            function = tf.function(steps, autograph=False, jit_compile=jit)
            self._concrete = function.get_concrete_function(self._data)
        self._function = function
        self.draws = sorted(_stateful_draws(self._concrete.graph))

    def _record(self, optimizer: Any, grads: Any, variables: Any, apply: Any) -> Any:
        """Keeps each variable's ``|gradient|`` at the outermost apply (a loss
        scale's is the inner's scaled: the noise floor is relative), where
        the step's graph holds it (not inside a ``cond``)."""
        if self._depth == 0:
            listed = optimizer_variables(optimizer) if variables is None else variables
            for grad, variable in zip(grads, listed):
                if grad is None or getattr(grad, "graph", None) is not self._graph:
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
        logs, grads = self._function(self._data)
        return logs, {k: np.asarray(g, np.float64) for k, g in grads.items()}


def _stateful_draws(graph: tf.Graph) -> set[str]:
    found = {op.type for op in graph.get_operations() if op.type in STATEFUL_DRAWS}
    for function in graph.as_graph_def().library.function:
        found |= {n.op for n in function.node_def if n.op in STATEFUL_DRAWS}
    return found

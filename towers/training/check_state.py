"""What the first-step check compares and puts back (``check.py``): every
variable a step may change, each model copy's, optimizer's and update's, and
of them the compared ones, with their owners and gradients' keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import global_seed_state, layers_of, leaf_metrics
from towers.step.rules.state import raw_variables


class Kept:
    """The values of ``variables`` now; :meth:`restore` puts them back."""

    def __init__(self, variables: list[Any]):
        self.variables = variables
        self.values = [np.array(v.numpy()) for v in variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)

    def read(self, entries: list[Watched]) -> list[np.ndarray]:
        """Each entry's value as kept (as restored), read only where not
        kept (a metric's result)."""
        kept = {id(v): value for v, value in zip(self.variables, self.values)}
        return [kept[e.key] if e.key in kept else e.read() for e in entries]

    def extend(self, made: list[tuple[Any, np.ndarray]]) -> None:
        """Keeps the variables ``made`` since (an optimizer built at its
        first apply), to be put back to their first values."""
        known = {id(v) for v in self.variables}
        for variable, value in made:
            if id(variable) not in known:
                self.variables.append(variable)
                self.values.append(value)


@dataclasses.dataclass
class Watched:
    """One compared quantity: a variable's value or a metric's result.

    Attributes:
      path, whose: its name and its layer, metric or optimizer.
      read: its value now, as NumPy.
      key: ``id`` of the variable (its gradient's key), 0 for a metric.
    """

    path: str
    whose: str
    read: Callable[[], np.ndarray]
    key: int = 0


def watched(model: keras.Model, optimizers: list[Any]) -> list[Watched]:
    """What one device's step changes, compared: ``model``'s variables (seed
    states and raw tf.Variables included), its optimizers' (a custom step's
    own too), Keras' global seed generator's, and the results of its metrics
    (what fit reports; their variables may count apart)."""
    found: dict[int, Watched] = {}
    own = own_optimizers(model)
    owned = [(v, v.path) for v in model.variables] + raw_variables(model)
    owned = [(v, path, "layer " + path.rsplit("/", 1)[0]) for v, path in owned]
    for optimizer in [*optimizers, *own]:
        owned += [
            (v, v.path, f"optimizer {optimizer.name}") for v in optimizer.variables
        ]
    seed = global_seed_state()
    if seed is not None:
        owned.append((seed, seed.path, "Keras' global seed generator"))
    for v, path, whose in owned:
        found.setdefault(id(v), Watched(path, whose, _reader(v), id(v)))
    entries = list(found.values())
    for metric in leaf_metrics(model):
        entries.append(Watched(metric.name, f"metric {metric.name}", _reader(metric)))
    return entries


def _reader(thing: Any) -> Callable[[], np.ndarray]:
    if isinstance(thing, keras.metrics.Metric):
        return lambda: np.concatenate(
            [
                np.ravel(np.asarray(r, np.float64))
                for r in tf.nest.flatten(thing.result())
            ]
        )
    return lambda: np.array(thing.numpy())


def own_optimizers(model: keras.Model) -> list[Any]:
    """The optimizers ``model`` holds as attributes (a GAN's two, its
    compiled one)."""
    return [
        o for o in vars(model).values() if isinstance(o, keras.optimizers.Optimizer)
    ]


def state_of(model: keras.Model, optimizers: list[Any]) -> list[Any]:
    """Every variable of ``model`` (its raw tf.Variables too), its metrics
    and its optimizers (a custom step's own too), and Keras' global seed
    generator's."""
    own = own_optimizers(model)
    found = [*model.variables, *[v for m in model.metrics for v in m.variables]]
    found += [v for v, _ in raw_variables(model)]  # a loss sum its step adds to
    found += [v for o in [*optimizers, *own] for v in o.variables]
    seed = global_seed_state()
    return [*found, *[seed] * (seed is not None)]


def engine_state(engine: Any) -> list[Any]:
    """Every variable towers' step may change: each copy's
    (:func:`state_of`), the updates' counters and accumulators."""
    found: dict[int, Any] = {}
    for model, optimizer in zip(engine.placement.models, engine.placement.optimizers):
        for v in state_of(model, [optimizer]):
            found.setdefault(id(v), v)
    for holder in _updates(engine.step):
        for value in list(vars(holder).values()):
            for v in _variables_in(value):
                found.setdefault(id(v), v)
    return list(found.values())


def _updates(step: Any) -> list[Any]:
    updates = step.updates()
    accumulators = [getattr(u, "accumulator", None) for u in updates]
    return [*updates, *[a for a in accumulators if a is not None]]


def _variables_in(value: Any) -> list[Any]:
    if isinstance(value, (tf.Variable, keras.Variable)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _variables_in(item)]
    return []


def with_slots(grads: dict, entries: list[Watched], trainable: list) -> dict:
    """``grads`` with each optimizer slot (Keras names one after its
    variable's path: ``dense_bias_momentum``) keyed to its variable's: a
    slot holds what the gradient's noise put there too."""
    grads = dict(grads)
    by_name = {v.path.replace("/", "_"): v for v in trainable if id(v) in grads}
    for entry in entries:
        name = entry.path.rsplit("/", 1)[-1]
        owner = max(
            (k for k in by_name if name.startswith(k + "_")), key=len, default=None
        )
        if entry.key and owner is not None:
            grads.setdefault(entry.key, grads[id(by_name[owner])])
    return grads


def not_compared(engine: Any) -> str | None:
    """Why ``engine``'s step is not one device's to compare with, or None."""
    step, options = engine.step, []
    if engine.cluster is not None:
        return "in a cluster, the other workers' shards are not in this process"
    if step.accumulate_steps > 1:
        return "accumulate_steps > 1: the first step applies nothing yet"
    if len(engine.devices) == 1:
        return None  # one tower: every other option is one device's
    if step.placement.name == "independent":
        options.append("placement='independent' (no combine: the zero-sync floor)")
    moving = step.moving_statistics
    if moving.layers and not all(moving.whole_batch(x) for x in moving.layers):
        options.append("batch_statistics='tower'")
    if moving.layers and moving.policy != "batch":
        options.append(f"moving_statistics={moving.policy!r}")
    if step.builtin.coupled.policy == "per_tower":
        options.append("coupled_losses='per_tower'")
    if getattr(engine.reducer, "wire_dtype", None) is not None:
        options.append(f"reducer={engine.reducer.name!r} (16 bits on the wire)")
    if options:
        return "options chosen per tower, not one device's: " + ", ".join(options)
    return None


def compute_dtype(model: keras.Model) -> str:
    """The least precise dtype ``model``'s layers compute in ("float8" for a
    layer quantized to it from less than float64: float8 rounds an element
    a quarter of its value up where the other side's float32 value lies a
    rounding below the boundary; from float64 none lies that near)."""
    found = set()
    for layer in layers_of(model):
        policy = layer.dtype_policy
        float8 = getattr(policy, "quantization_mode", None) == "float8"
        found.add(
            "float8" if float8 and policy.compute_dtype != "float64"
            else policy.compute_dtype
        )  # fmt: skip
    order = ["float8", "bfloat16", "float16", "float32", "float64"]
    return next((d for d in order if d in found), "float32")


def kept_run(engine: Any, run: Callable[[], Any]) -> Any:
    """``run()``, every variable of :func:`engine_state` put back after."""
    kept = Kept(engine_state(engine))
    try:
        return run()
    finally:
        kept.restore()

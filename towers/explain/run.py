"""``towers explain``: where every variable and op of a training step lived.

The report is read from the graphs TensorFlow placed and ran, not from what the
engine asked for: ``explain`` traces a fresh copy of the engine's step, runs it
once on a batch while TensorFlow records the partitioned graphs (one per device,
each node on the device that ran it, ``_Send``/``_Recv`` pairs where a tensor
crossed devices), then puts every variable back as it was, so the engine is left
exactly as it was found. ``towers/explain/graph.py`` reads those graphs (the
step's stages are its name scopes); ``towers/explain/report.py`` renders them.

A read of a shared variable runs where the variable lives, so a tower's forward
pass has a few ops on the variable device: the reads whose values then cross to
the tower's device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import tensorflow as tf

from towers import _runtime
from towers.explain.diagram import draw
from towers.explain.graph import (
    Transfer,
    VariableInfo,
    XlaCall,
    count_ops,
    device_key,
    placed_variables,
    step_partitions,
    transfers,
    xla_calls,
)
from towers.explain.report import render
from towers.split import split_sizes
from towers.step.rules.state import describe
from towers.training.compiled import traced


@dataclass
class Explanation:
    """What one training step did where. ``str()`` gives the report."""

    devices: list[str]
    variable_device: str
    placement: str
    sizes: list[int]
    variables: list[VariableInfo]
    # stage -> device -> number of ops TensorFlow ran there
    ops: dict[str, dict[str, int]]
    transfers: list[Transfer]
    unknown_bytes: int = 0  # sent tensors whose size was not static
    workers: int = 1
    xla: list[XlaCall] = field(default_factory=list)  # with jit_compile
    # the model's loss terms that couple the batch's examples, and how each is
    # computed (towers/step/rules/coupled.py)
    coupled: list[str] = field(default_factory=list)
    # the variables the towers' passes assign, each with the rule that assigns
    # it once a step (towers/step/rules/state.py)
    assigned: list[str] = field(default_factory=list)
    # where a model's own train_step made the towers meet (towers/step/work/own.py)
    meetings: list[str] = field(default_factory=list)

    def ran_on(self, stage: str) -> list[str]:
        """The devices that ran ops of ``stage`` (e.g. ``"apply"``), most first."""
        counts = self.ops.get(stage, {})
        return sorted(counts, key=lambda d: (-counts[d], d))

    @property
    def bytes_crossing(self) -> int:
        """Bytes sent from one device to another per step (collectives included:
        the bytes each device puts into them)."""
        return sum(t.bytes for t in self.transfers)

    @property
    def all_devices(self) -> list[str]:
        """Every device that ran an op or holds a variable, host first."""
        seen = {d for counts in self.ops.values() for d in counts}
        seen |= {v.device for v in self.variables}
        return sorted(seen, key=device_key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return render(self)

    def save_png(self, path: str) -> None:
        """Draws the step: devices as columns, the data path as arrows."""
        draw(self, path)


class Explainable(Protocol):
    """What ``explain`` reads of an engine (``towers.Towers`` has it)."""

    devices: list[str]
    variable_device: str
    placement: Any  # a towers.placement.base.Placement: name, models, optimizers
    cluster: Any  # a towers.Cluster, or None
    step: Any  # a towers.step.step.Step: the train step, update
    metrics: list  # the model's Keras metrics, the loss tracker's included

    def prepare(self, x: Any, y: Any) -> tuple[Any, Any, Any]: ...


def explain(engine: Explainable, x: Any, y: Any) -> Explanation:
    """Runs one step on ``(x, y)`` as TensorFlow places it, then undoes it.

    Args:
      engine: a ``towers.Towers``.
      x, y: one batch, as ``train_step`` takes it.

    Returns:
      The :class:`Explanation` of that step.

    Raises:
      ValueError: the model has a loss term that training would refuse: it
        is probed first, as fit's first step probes it
        (``towers/step/rules/probe.py``).

    Example:
      >>> eng = make_engine()  # in a cluster every worker calls it
      >>> report = eng.explain(np.ones((5, 3), "f4"), np.zeros((5, 1), "f4"))
      >>> report.sizes, report.ran_on("apply"), report.ran_on("tower 1 backward")
      ([3, 2], ['/device:CPU:0'], ['/device:CPU:1'])
      >>> int(eng.optimizer.iterations.numpy())  # explaining did not train
      0
    """
    x, y, sample_weight = engine.prepare(x, y)
    engine.step.probe(x, y, sample_weight)
    concrete = traced(engine.step.train).get_concrete_function(x, y, sample_weight)
    saved = [(var, tf.identity(var.read_value())) for var in concrete.variables]
    try:
        with _runtime.placed_graphs() as functions:
            tf.nest.map_structure(_read, concrete(x, y, sample_weight))
    finally:
        for var, value in saved:  # the engine is left as it was found
            var.assign(value)
    graphs = step_partitions(functions, len(concrete.graph.inputs))
    if not graphs:
        raise RuntimeError(
            "TensorFlow recorded no placed graph for the step; received none from "
            "its run metadata, expected one per device"
        )
    batch = int(tf.nest.flatten(x)[0].shape[0])
    crossed = transfers(concrete.graph, graphs)
    return Explanation(
        devices=list(engine.devices),
        variable_device=engine.variable_device,
        placement=engine.placement.name,
        sizes=split_sizes(batch, len(engine.devices)),
        variables=placed_variables(_owners(engine), concrete, graphs),
        ops=count_ops(graphs),
        transfers=crossed.transfers,
        unknown_bytes=crossed.unknown,
        workers=1 if engine.cluster is None else engine.cluster.num_workers,
        xla=xla_calls(concrete.graph),
        coupled=engine.step.builtin.coupled.describe(),
        assigned=[
            f"{path}: {describe(rule)}" for path, rule in engine.step.assigned.items()
        ],
        meetings=[
            f"{optimizer}.apply: every tower's gradients, weighted by its share "
            f"of the examples, summed and applied once on {engine.variable_device}"
            for optimizer in engine.step.meetings
        ],
    )


def _owners(engine: Explainable) -> dict[int, tuple[str, str]]:
    """tf.Variable id -> (owner, Keras path) for the engine's Keras objects, in
    the order the report lists them."""
    groups: list[tuple[str, list]] = [
        *[("model", m.variables) for m in engine.placement.models],
        *[("optimizer", o.variables) for o in engine.placement.optimizers],
        ("metrics", [v for m in engine.metrics for v in m.variables]),
    ]
    owners: dict[int, tuple[str, str]] = {}
    for owner, variables in groups:
        for var in variables:
            value = getattr(var, "value", var)
            owners.setdefault(id(value), (owner, getattr(var, "path", var.name)))
    steps = engine.step.update.steps
    if steps is not None:
        owners[id(steps)] = ("towers", "steps_done")
    return owners


def _read(value: Any) -> Any:
    return value.numpy() if hasattr(value, "numpy") else value

"""``towers explain``: where every variable and op of a training step lived.

The report is read from the graphs TensorFlow placed and ran, not from what the
engine asked for: ``explain`` traces a fresh copy of the engine's step, runs it
once on a batch while TensorFlow records the partitioned graphs (one per device,
each node on the device that ran it, ``_Send``/``_Recv`` pairs where a tensor
crossed devices), then puts every variable back as it was, so the engine is left
exactly as it was found.

Ops are grouped into the step's stages by the name scopes the engine opens::

    split                    the batch cut into shards (on the host)
    tower t forward          tower t's forward pass and loss
    tower t backward         tower t's gradients (GradientTape)
    combine                  the towers' gradients summed (combine_gradients)
    across workers           the sum across worker processes, in a cluster
    apply                    the optimizer's update (once per step)
    metrics                  loss and metric tracking

A read of a shared variable runs where the variable lives, so a tower's forward
pass has a few ops on the variable device: the reads whose values then cross to
the tower's device.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.devices import _local_name
from towers.split import split_sizes

# Nodes that move or pass values rather than compute: counted as transfers or not
# at all.
_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "NoOp"}
_COLLECTIVES = {
    "CollectiveReduceV2": "all-reduce",
    "CollectiveReduceV3": "all-reduce",
    "CollectiveGatherV2": "all-gather",
    "CollectiveBcastSendV2": "broadcast",
}
_STAGE_ORDER = ("split", "forward", "backward", "combine", "across workers", "apply")


@dataclass(frozen=True)
class VariableInfo:
    """One variable the step reads or writes, on the device its handle lives on."""

    owner: str  # "model", "optimizer", "metrics" or "towers" (the engine's own)
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    device: str


@dataclass(frozen=True)
class Transfer:
    """Tensors of one kind sent from one device (and stage) to another per step.

    ``kind``: ``"batch"`` (shards of the input), ``"weights"`` (values of shared
    variables read where they live), ``"gradients"``, ``"combined gradients"``,
    ``"outputs"`` (losses, predictions) or, for a collective op, its kind
    (``"all-reduce"``), whose ``target`` is ``"collective group"``.
    """

    source: str
    target: str
    kind: str
    source_stage: str
    target_stage: str
    tensors: int
    bytes: int


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
        return sorted(seen, key=_device_key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        from towers.explain_report import render

        return render(self)

    def save_png(self, path: str) -> None:
        """Draws the step: devices as columns, the data path as arrows."""
        from towers.explain_report import draw

        draw(self, path)


def explain(engine: Any, x: Any, y: Any) -> Explanation:
    """Runs one step on ``(x, y)`` as TensorFlow places it, then undoes it.

    Args:
      engine: a ``towers.Towers``.
      x, y: one batch, as ``train_step`` takes it.

    Returns:
      The :class:`Explanation` of that step.
    """
    x, y = engine._prepare(x, y)
    concrete = tf.function(engine._step).get_concrete_function(x, y)
    saved = [(var, tf.identity(var.read_value())) for var in concrete.variables]
    try:
        with _runtime.placed_graphs() as functions:
            tf.nest.map_structure(lambda t: t.numpy(), concrete(x, y))
    finally:
        for var, value in saved:  # the engine is left as it was found
            var.assign(value)
    graphs = _step_partitions(functions, len(concrete.graph.inputs))
    if not graphs:
        raise RuntimeError(
            "TensorFlow recorded no placed graph for the step; received none from "
            "its run metadata, expected one per device"
        )
    batch = int(tf.nest.flatten(x)[0].shape[0])
    transfers, unknown = _transfers(concrete.graph, graphs)
    return Explanation(
        devices=list(engine.devices),
        variable_device=engine.variable_device,
        placement=engine.placement,
        sizes=split_sizes(batch, engine.num_towers),
        variables=_variables(engine, concrete, graphs),
        ops=_count_ops(graphs),
        transfers=transfers,
        unknown_bytes=unknown,
        workers=1 if engine.workers is None else engine.workers.cluster.size,
    )


def stage_of(name: str) -> str:
    """The step stage of a node, from the name scopes the engine opens.

    >>> stage_of("gradient_tape/tower_1/sequential/dense/MatMul")
    'tower 1 backward'
    >>> stage_of("combine_1/AddN"), stage_of("ConstantFolding/apply/Adam/Sub")
    ('combine', 'apply')
    """
    parts = name.split("/")
    while len(parts) > 1 and re.fullmatch(r"[A-Z]\w*", parts[0]):
        parts = parts[1:]  # a Grappler pass's prefix: ConstantFolding/tower_1/...
    backward = parts[0] == "gradient_tape" and len(parts) > 1
    scope = parts[1] if backward else parts[0]
    tower = re.fullmatch(r"tower_(\d+)", scope)
    if tower:
        return f"tower {tower.group(1)} {'backward' if backward else 'forward'}"
    base = re.sub(r"_\d+$", "", scope)
    if base in ("combine", "all_reduce"):
        return "combine"
    if base == "across_workers":
        return "across workers"
    if base in ("split", "apply", "metrics"):
        return base
    return "other"


def stage_rank(stage: str) -> tuple[int, int]:
    """Where a stage comes in the data path, for ordering rows."""
    tower = re.fullmatch(r"tower (\d+) (forward|backward)", stage)
    if tower:
        return (_STAGE_ORDER.index(tower.group(2)), int(tower.group(1)))
    if stage in _STAGE_ORDER:
        return (_STAGE_ORDER.index(stage), 0)
    return (len(_STAGE_ORDER) + (stage != "metrics"), 0)


def _device_key(device: str) -> tuple[bool, str, int]:
    spec = tf.DeviceSpec.from_string(device)
    # The host's CPU first, then accelerators in order.
    return (spec.device_type != "CPU", spec.device_type or "", spec.device_index or 0)


def _step_partitions(functions: list, num_inputs: int) -> list:
    """The step's partitions among the functions TensorFlow instantiated: the
    largest function taking the step's inputs (others are, e.g., the one-op
    functions TensorFlow wraps eager ops in)."""

    def size(partitions, op=None):
        return sum(
            (node.op == op) if op else (node.op not in _PLUMBING)
            for graph in partitions
            for node in graph.node
        )

    candidates = [f for f in functions if size(f, "_Arg") == num_inputs]
    return max(candidates, key=size, default=[])


def _count_ops(graphs: list) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for graph in graphs:
        for node in graph.node:
            if node.op not in _PLUMBING:
                counts[stage_of(node.name)][_local_name(node.device)] += 1
    ordered = sorted(counts, key=stage_rank)
    return {stage: dict(sorted(counts[stage].items())) for stage in ordered}


def _variables(engine: Any, concrete: Any, graphs: list) -> list[VariableInfo]:
    """Every variable the step captured, on the device its ``_Arg`` was placed on."""
    owners = _owners(engine)
    first_capture = len(concrete.graph.inputs) - len(concrete.captured_inputs)
    by_handle = {id(var.handle): var for var in concrete.variables}
    placed = {}
    for graph in graphs:
        for node in graph.node:
            index = node.attr["index"].i if node.op == "_Arg" else -1
            if first_capture <= index < len(concrete.graph.inputs):
                handle = concrete.captured_inputs[index - first_capture]
                if id(handle) in by_handle:
                    placed[id(by_handle[id(handle)])] = _local_name(node.device)
    infos = []
    for var in concrete.variables:
        owner, name = owners.get(id(var), ("towers", var.name.split(":")[0]))
        shape = tuple(var.shape.as_list())
        infos.append(
            VariableInfo(
                owner=owner,
                name=name,
                shape=shape,
                dtype=var.dtype.name,
                bytes=var.shape.num_elements() * var.dtype.size,
                device=placed.get(id(var), _local_name(var.handle.device)),
            )
        )
    rank = {key: i for i, key in enumerate(owners.values())}
    return sorted(infos, key=lambda v: rank.get((v.owner, v.name), len(rank)))


def _owners(engine: Any) -> dict[int, tuple[str, str]]:
    """tf.Variable id -> (owner, Keras path) for the engine's Keras objects, in
    the order the report lists them."""
    owners: dict[int, tuple[str, str]] = {}
    models = [engine.model]
    if engine.replicas is not None:
        models += list(engine.replicas.models)
    groups = [("model", m.variables) for m in models]
    groups.append(("optimizer", engine.optimizer.variables))
    trackers = [engine.loss_tracker, *engine.metrics]
    groups.append(("metrics", [v for m in trackers for v in m.variables]))
    for owner, variables in groups:
        for var in variables:
            value = getattr(var, "value", var)
            owners.setdefault(id(value), (owner, getattr(var, "path", var.name)))
    steps = engine.update.steps
    if steps is not None:
        owners[id(steps)] = ("towers", "steps_done")
    return owners


def _transfers(graph: tf.Graph, graphs: list) -> tuple[list[Transfer], int]:
    """Tensors crossing devices (``_Send``) and entering collectives, per step;
    and how many sent tensors have no static size (shapes known only at run
    time, or ops Grappler made whose receiver does not tell)."""
    consumers = _receivers(graphs)
    totals: dict[tuple, list[int]] = {}
    unknown = 0
    for placed in graphs:
        nodes = {node.name: node for node in placed.node}
        for node in placed.node:
            source = node.input[0] if node.input else ""
            if "/ctrl/" in source:
                continue  # a control edge across devices: no data
            if node.op in ("_Send", "_HostSend"):
                target = _local_name(node.attr["recv_device"].s.decode())
                consumer = consumers.get(node.attr["tensor_name"].s)
                target_stage = stage_of(consumer[0]) if consumer else "other"
                size = _bytes(graph, source) or _bytes_expected(graph, consumer)
            elif node.op in _COLLECTIVES:
                target, target_stage = "collective group", stage_of(node.name)
                size = _bytes(graph, source)
            else:
                continue
            if size is None:
                unknown += 1
                continue
            name = source.split(":")[0]
            stage = stage_of(name)
            kind = _COLLECTIVES.get(node.op) or _kind(nodes.get(name), stage)
            key = (_local_name(node.device), target, kind, stage, target_stage)
            total = totals.setdefault(key, [0, 0])
            total[0] += 1
            total[1] += size
    return [Transfer(*key, *total) for key, total in totals.items()], unknown


def _receivers(graphs: list) -> dict[bytes, tuple[str, int]]:
    """Each ``_Recv``'s tensor name -> (the op that consumed it, which input)."""
    recvs = {}
    for placed in graphs:
        by_input = {}
        for node in placed.node:
            for k, source in enumerate(node.input):
                by_input.setdefault(source.split(":")[0], (node.name, k))
        for node in placed.node:
            if node.op in ("_Recv", "_HostRecv") and node.name in by_input:
                recvs[node.attr["tensor_name"].s] = by_input[node.name]
    return recvs


def _kind(node: Any, stage: str) -> str:
    if node is not None and node.op == "ReadVariableOp":
        return "weights"
    if stage == "split":
        return "batch"
    if stage.endswith("backward"):
        return "gradients"
    if stage in ("combine", "across workers"):
        return "combined gradients"
    return "outputs"


def _bytes(graph: tf.Graph, source: str) -> int | None:
    """Bytes of the traced tensor ``source`` ("op:index"), None if unknown."""
    name, _, index = source.partition(":")
    try:
        tensor = graph.get_operation_by_name(name).outputs[int(index or 0)]
    except (KeyError, ValueError, IndexError):
        return None
    if not tensor.shape.is_fully_defined() or tensor.dtype == tf.resource:
        return None
    return tensor.shape.num_elements() * tensor.dtype.size


def _bytes_expected(graph: tf.Graph, consumer: tuple[str, int] | None) -> int | None:
    """Bytes of the tensor the receiving op takes at that input, for a sent tensor
    that Grappler made (e.g. a bias gradient out of a fused Conv2D gradient)."""
    if consumer is None:
        return None
    try:
        op = graph.get_operation_by_name(consumer[0])
        tensor = op.inputs[consumer[1]]
    except (KeyError, IndexError):
        return None
    return _bytes(graph, f"{tensor.op.name}:{tensor.value_index}")

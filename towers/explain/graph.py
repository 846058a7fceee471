"""Reading the graphs TensorFlow placed: which stage each op belongs to, how many
ran on each device, where each variable lived, and what crossed devices.

Ops are grouped into the step's stages by the name scopes the step opens
(``towers/step/step.py``)::

    split                    the batch cut into shards (on the host)
    tower t forward          tower t's forward pass and loss
    tower t XLA              with jit_compile: tower t's forward and backward
                             passes, one XLA computation (one op, a call); with
                             global batch statistics one per phase, the towers'
                             sums between them (towers/step/run/phases.py)
    tower t backward         tower t's gradients (GradientTape)
    combine                  the towers' gradients summed (combine_gradients)
    across workers           the sum across worker processes, in a cluster
    apply                    the optimizer's update (once per step)
    metrics                  loss and metric tracking
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.devices import local_name

# Nodes that move or pass values rather than compute: counted as transfers or not
# at all.
_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "NoOp"}
_COLLECTIVES = {
    "CollectiveReduceV2": "all-reduce",
    "CollectiveReduceV3": "all-reduce",
    "CollectiveGatherV2": "all-gather",
    "CollectiveBcastSendV2": "broadcast",
}
_STAGE_ORDER = (
    "split",
    "forward",
    "XLA",
    "backward",
    "combine",
    "across workers",
    "apply",
)
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


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
    variables read where they live; their ``source_stage`` is
    ``"variables"``), ``"gradients"``, ``"combined gradients"``, a tower's
    ``"loss"`` (its share, summed where the gradients are) and
    ``"predictions"`` (for the metrics), ``"updates"`` (the optimizer's,
    computed on one device for a variable on another), other ``"outputs"``,
    or, for a
    collective op, its kind (``"all-reduce"``), whose ``target`` is
    ``"collective group"``.
    """

    source: str
    target: str
    kind: str
    source_stage: str
    target_stage: str
    tensors: int
    bytes: int


def stage_of(name: str) -> str:
    """The step stage of a node, from the name scopes the engine opens.

    >>> stage_of("gradient_tape/tower_1/sequential/dense/MatMul")
    'tower 1 backward'
    >>> stage_of("tower_1/StatefulPartitionedCall/gradient_tape/dense/MatMul")
    'tower 1 backward'
    >>> stage_of("tower_1/PartitionedCall"), stage_of("tower_1/PartitionedCall/_13")
    ('tower 1 XLA', 'tower 1 XLA')
    >>> stage_of("combine_1/AddN"), stage_of("ConstantFolding/apply/Adam/Sub")
    ('combine', 'apply')

    A tower's call that stayed a call is an XLA computation: TensorFlow
    inlines every other call of the step into it (the sends and receives of
    the call's values are named after it: ``.../_13``).
    """
    parts = name.split("/")
    while len(parts) > 1 and _is_prefix(parts[0]):
        parts = parts[1:]  # a Grappler pass's prefix: ConstantFolding/tower_1/...
    backward = parts[0] == "gradient_tape" and len(parts) > 1
    scope = parts[1] if backward else parts[0]
    tower = re.fullmatch(r"tower_(\d+)(?:_\d+)?", scope)  # _1: the scope again
    if tower:
        # A tower traced once (towers/step/run/phases.py) is a call inlined into
        # the step: its ops are named tower_1/PartitionedCall/gradient_tape/...
        if parts[1:2] and parts[1] in _CALLS and _is_transfer(parts[2:]):
            return f"tower {tower.group(1)} XLA"
        inner = [part for part in parts[1:] if not _is_prefix(part)]
        backward = backward or inner[:1] == ["gradient_tape"]
        return f"tower {tower.group(1)} {'backward' if backward else 'forward'}"
    base = re.sub(r"_\d+$", "", scope)
    if base in ("combine", "all_reduce", "divisors"):
        return "combine"
    if base == "across_workers":
        return "across workers"
    if base in ("split", "apply", "metrics"):
        return base
    return "other"


def _is_transfer(rest: list[str]) -> bool:
    """Whether what follows a call's name is nothing, or a send or receive
    of its values (``_13``)."""
    return not rest or (len(rest) == 1 and re.fullmatch(r"_\d+", rest[0]) is not None)


def _is_prefix(part: str) -> bool:
    """A name part TensorFlow adds: a Grappler pass's, or an inlined call's."""
    return re.fullmatch(r"[A-Z]\w*", part) is not None


def stage_rank(stage: str) -> tuple[int, int]:
    """Where a stage comes in the data path, for ordering rows."""
    tower = re.fullmatch(r"tower (\d+) (forward|XLA|backward)", stage)
    if tower:
        return (_STAGE_ORDER.index(tower.group(2)), int(tower.group(1)))
    if stage in _STAGE_ORDER:
        return (_STAGE_ORDER.index(stage), 0)
    return (len(_STAGE_ORDER) + (stage != "metrics"), 0)


def device_key(device: str) -> tuple[bool, str, int]:
    spec = tf.DeviceSpec.from_string(device)
    # The host's CPU first, then accelerators in order.
    return (spec.device_type != "CPU", spec.device_type or "", spec.device_index or 0)


def step_partitions(functions: list, num_inputs: int) -> list:
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


def count_ops(graphs: list) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for graph in graphs:
        for node in graph.node:
            if node.op not in _PLUMBING:
                counts[stage_of(node.name)][local_name(node.device)] += 1
    ordered = sorted(counts, key=stage_rank)
    return {stage: dict(sorted(counts[stage].items())) for stage in ordered}


def placed_variables(
    owners: dict[int, tuple[str, str]], concrete: Any, graphs: list
) -> list[VariableInfo]:
    """Every variable the step captured, on the device its ``_Arg`` was placed on.

    Args:
      owners: ``id(tf.Variable)`` -> (owner, name) for the variables the caller
        can name, in the order to list them; others are ``("towers", name)``.
      concrete: the step's concrete function.
      graphs: its placed partitions.
    """
    first_capture = len(concrete.graph.inputs) - len(concrete.captured_inputs)
    by_handle = {id(var.handle): var for var in concrete.variables}
    placed = {}
    for graph in graphs:
        for node in graph.node:
            index = node.attr["index"].i if node.op == "_Arg" else -1
            if first_capture <= index < len(concrete.graph.inputs):
                handle = concrete.captured_inputs[index - first_capture]
                if id(handle) in by_handle:
                    placed[id(by_handle[id(handle)])] = local_name(node.device)
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
                device=placed.get(id(var), local_name(var.handle.device)),
            )
        )
    rank = {key: i for i, key in enumerate(owners.values())}
    return sorted(infos, key=lambda v: rank.get((v.owner, v.name), len(rank)))


@dataclass
class Crossings:
    """What crossed devices in one step.

    Attributes:
      transfers: tensors sent, grouped by devices, kind and stages.
      unknown: how many sent tensors have no static size (shapes known only at
        run time, or ops Grappler made whose receiver does not tell).
    """

    transfers: list[Transfer]
    unknown: int


def transfers(graph: tf.Graph, graphs: list) -> Crossings:
    """Tensors crossing devices (``_Send``) and entering collectives, per step."""
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
                target = local_name(node.attr["recv_device"].s.decode())
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
            stage = stage_of(_origin(graph, name))
            kind = _COLLECTIVES.get(node.op) or _kind(
                nodes.get(name), stage, target_stage
            )
            if kind == "weights":  # read where the variable lives, for a tower
                stage = "variables"
            key = (local_name(node.device), target, kind, stage, target_stage)
            total = totals.setdefault(key, [0, 0])
            total[0] += 1
            total[1] += size
    return Crossings([Transfer(*key, *total) for key, total in totals.items()], unknown)


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


def _kind(node: Any, stage: str, target_stage: str) -> str:
    if node is not None and node.op == "ReadVariableOp":
        return "weights"
    if stage == "split":
        return "batch"
    if stage.endswith("backward"):
        return "gradients"
    if stage.endswith("XLA"):
        return "gradients, outputs"
    if stage in ("combine", "across workers"):
        return "combined gradients"
    if stage == "apply":  # the optimizer's update, made where it is computed
        return "updates"
    return {"combine": "loss", "metrics": "predictions"}.get(target_stage, "outputs")


def _traced_op(graph: tf.Graph, name: str) -> Any:
    """The traced op a placed node is, looked up through the calls it was
    inlined from (``tower_1/StatefulPartitionedCall/MatMul``); None if none."""
    try:
        return graph.get_operation_by_name(name)
    except KeyError:
        pass
    parts = name.split("/")
    for split in range(1, len(parts)):
        inner = _runtime.called_graph(graph, "/".join(parts[:split]))
        if inner is not None:
            return _traced_op(inner, "/".join(parts[split:]))
    return None


def _origin(graph: tf.Graph, name: str) -> str:
    """The placed node ``name``, or for an inlined call's output (its
    ``Identity``) the node that made the value: what its stage is read from."""
    op = _traced_op(graph, name)
    if op is None or op.type != "Identity" or op.graph is graph:
        return name
    while op.type == "Identity" and op.inputs:
        op = op.inputs[0].op
    caller = name[: -len(name.split("/")[-1])]
    return caller + op.name


def _bytes(graph: tf.Graph, source: str) -> int | None:
    """Bytes of the traced tensor ``source`` ("op:index"), None if unknown."""
    name, _, index = source.partition(":")
    op = _traced_op(graph, name)
    try:
        tensor = op.outputs[int(index or 0)]
    except (AttributeError, ValueError, IndexError):
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


@dataclass(frozen=True)
class XlaCall:
    """One tower's XLA computation in the traced step."""

    stage: str  # "tower t XLA"
    device: str
    function: str  # the traced function's name
    ops: int  # the ops XLA compiles into one computation


def xla_calls(graph: tf.Graph) -> list[XlaCall]:
    """The calls of ``graph`` that TensorFlow runs as one XLA computation each
    (``_XlaMustCompile``), in the order the step makes them."""
    calls = []
    for op in graph.get_operations():
        attr = op.node_def.attr.get("_XlaMustCompile")
        if op.type not in _CALLS or attr is None or not attr.b:
            continue
        name = op.get_attr("f").name
        ops = len(graph._get_function(name).cached_definition.node_def)
        calls.append(XlaCall(stage_of(op.name), local_name(op.device), name, ops))
    return calls

"""A tower's pass traced once and cut into phases where the towers meet.

:func:`trace` traces the pass alone into a graph that never runs, its seat a
``seats.CutSeat`` (each sum a placeholder, each action recorded); each op
gets its phase (``schedule.py``), and each phase becomes one function (with
XLA, one computation) of ops imported from the trace: a :class:`Plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.step.run import seats, xla
from towers.step.run.schedule import Schedule, is_tensor, tensors_of
from towers.step.run.seats import CutSeat, Sum


@dataclasses.dataclass
class Phase:
    """The ops of one phase, as one function.

    Attributes:
      function: ``function(*inputs) -> outputs``, a ``tf.function``.
      inputs, outputs: the names of the traced graph's tensors it reads and
        gives (``"op:0"``).
    """

    function: Callable[..., Any]
    inputs: list[str]
    outputs: list[str]


@dataclasses.dataclass
class Plan:
    """A tower's pass, traced and cut (see the module docstring).

    Attributes:
      inputs: names of the traced graph's inputs: the call's tensors
        (:func:`tensors_of`), then the outer tensors the trace captured.
      captured: the outer tensors the trace captured.
      phases: by phase, its function (None: no op of that phase is needed).
      meetings: the sums over the towers, in the order the pass made them.
      skeleton: the pass's result, its tensors replaced (``xla.function``).
      results: names of the result's tensors, in the skeleton's order.
      constants: values of the result's tensors that are constants, by name.
    """

    inputs: list[str]
    captured: list[tf.Tensor]
    phases: list[Phase | None]
    meetings: list[Sum]
    skeleton: Any
    results: list[str]
    constants: dict[str, tf.Tensor]


def trace(
    work: Callable[..., Any],
    args: tuple,
    jit: bool = True,
    inline: bool = True,
    meets: bool = True,
    own: bool = False,
) -> Plan:
    """``work(*args)`` traced alone and cut into phases.

    ``args``: a nest of tensors (and None); the plan serves any call with
    tensors of the same shapes and dtypes. Each phase is an ``xla.function``
    (``inline``: inlined into the step's graph); ``meets``, ``own``:
    :class:`CutSeat`'s.
    """
    seat = CutSeat(meets, own)
    with _runtime.pass_graph("tower_pass", jit) as graph:
        placeholders = [
            tf.raw_ops.Placeholder(dtype=a.dtype, shape=a.shape, name="arg")
            for a in tensors_of(args)
        ]
        seat.graph, seat.inputs = graph, placeholders
        fed = iter(placeholders)
        inner = tf.nest.pack_sequence_as(
            args,
            [next(fed) if is_tensor(a) else a
             for a in tf.nest.flatten(args, expand_composites=True)],
            expand_composites=True,
        )  # fmt: skip
        with seats.seated(seat):
            leaves: list[Any] = []
            skeleton = xla.split_leaves(work(*inner), leaves)
    inputs = placeholders + [internal for _, internal in graph.captures]
    results = list(tf.nest.flatten(leaves, expand_composites=True))
    schedule = Schedule(graph, inputs, seat.meetings, results)
    if jit:
        schedule.check_compilable()
    library = graph.as_graph_def().library
    return Plan(
        inputs=[t.name for t in inputs],
        captured=[external for external, _ in graph.captures],
        phases=[
            _phase_function(schedule, k, library, jit, inline)
            if schedule.by_phase[k]
            else None
            for k in range(len(schedule.outputs))
        ],
        meetings=seat.meetings,
        skeleton=(skeleton, leaves),
        results=[t.name for t in results],
        constants={
            t.name: tf.constant(tf.make_ndarray(t.op.get_attr("value")))
            for t in results + schedule.handed
            if schedule.kind(t.op) == "constant"
        },
    )


def _phase_function(
    schedule: Schedule, k: int, library: Any, jit: bool, inline: bool
) -> Phase:
    # Phase k's ops as one function of the tensors they read from elsewhere.
    nodes, copied, reads = [], set(), []
    for op in schedule.by_phase[k]:
        node = _without_inputs(op.node_def)
        for tensor in op.inputs:
            source = tensor.op
            if schedule.kind(source) == "constant":
                if source.name not in copied:  # a constant waits for nothing
                    copied.add(source.name)
                    nodes.append(_without_inputs(source.node_def))
            elif schedule.kind(source) == "fed" or schedule.phase[source.name] != k:
                if tensor.name not in reads:
                    reads.append(tensor.name)
            node.input.append(_input_name(tensor))
        for control in op.control_inputs:  # earlier phases ran before
            if schedule.phase[control.name] == k and schedule.kind(control) == "op":
                node.input.append(f"^{control.name}")
        nodes.append(node)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(nodes)
    graph_def.library.CopyFrom(library)
    outputs = schedule.outputs[k]
    shapes = [schedule.graph.get_tensor_by_name(name).shape for name in outputs]

    # The traced graph is dropped once cut, and with it the functions its
    # ops call, unless each phase's graph holds them.
    functions = _runtime.functions_of(schedule.graph)

    def body(*tensors: tf.Tensor) -> list[tf.Tensor]:
        made = tf.graph_util.import_graph_def(
            graph_def,
            input_map=dict(zip(reads, tensors)),
            return_elements=outputs,
            name="",
        )
        _runtime.add_functions(functions)  # in place of the import's copies
        for tensor, shape in zip(made, shapes):
            tensor.set_shape(shape)  # a shape read from an earlier phase
        return made

    body.__name__ = f"tower_phase_{k}"
    return Phase(xla.function(body, jit, inline), reads, outputs)


def _without_inputs(node_def: Any) -> Any:
    """A copy of ``node_def`` with no inputs and no colocation (one phase runs
    as one computation on one device; the op it was colocated with may be in
    another)."""
    node = tf.compat.v1.NodeDef()
    node.CopyFrom(node_def)
    del node.input[:]
    if "_class" in node.attr:
        del node.attr["_class"]
    return node


def _input_name(tensor: tf.Tensor) -> str:
    return tensor.op.name if tensor.value_index == 0 else tensor.name


def join(skeleton: Any, flat: list[tf.Tensor]) -> Any:
    """A result from its ``trace`` skeleton and its tensors' values."""
    structure, leaves = skeleton
    rebuilt = tf.nest.pack_sequence_as(leaves, flat, expand_composites=True)
    return xla.join_leaves(structure, iter(rebuilt))

"""A tower's pass traced once and cut into phases where the towers meet by sums.

:func:`trace` traces the pass alone into a graph that never runs, each sum
(``seats.total``) a placeholder recorded as an :class:`Sum`. The
graph's inputs are phase 0, a sum's placeholder one phase after what made its
value, any other op its inputs' latest; each phase becomes one function (with
XLA, one computation) of ops imported from the trace, and a :class:`Plan`
holds them. A phase keeps the ops its results need and the ops that run for
what they do (an assert, a print), as a ``tf.function`` runs every stateful
op it traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.step.run import seats, xla
from towers.step.run.seats import Action, CutSeat, Sum

# An op of no inputs that is copied into every phase that reads it.
_COPIED = ("Const",)
# Stateful ops that change nothing: run only where a result reads them.
_READS = ("ReadVariableOp", "VarHandleOp", "Placeholder")


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
    cut = _Cut(graph, inputs, seat.meetings, results)
    if jit:
        cut.check_compilable()
    library = graph.as_graph_def().library
    return Plan(
        inputs=[t.name for t in inputs],
        captured=[external for external, _ in graph.captures],
        phases=[
            cut.phase_function(k, library, jit, inline) if cut.by_phase[k] else None
            for k in range(len(cut.outputs))
        ],
        meetings=seat.meetings,
        skeleton=(skeleton, leaves),
        results=[t.name for t in results],
        constants={
            t.name: tf.constant(tf.make_ndarray(t.op.get_attr("value")))
            for t in results + cut.handed
            if cut.kind(t.op) == "constant"
        },
    )


def is_tensor(value: Any) -> bool:
    return isinstance(value, tf.Tensor)


def tensors_of(args: Any) -> list[Any]:
    """The tensors of ``args``, composites' parts included, in order; other
    values (None, numbers) are traced as they are."""
    return [a for a in tf.nest.flatten(args, expand_composites=True) if is_tensor(a)]


class _Cut:
    """Each op of a traced tower's pass with its phase, and what each phase
    reads and gives."""

    def __init__(self, graph, inputs, meetings, results):
        self.graph = graph
        self.fed = {t.op.name for t in inputs}
        self.sums = {e.result.op.name: e for e in meetings if isinstance(e, Sum)}
        self.actions = [e for e in meetings if isinstance(e, Action)]
        # What the towers hand in: each sum's value, each action's tensors
        # (an action runs for what it does: what it is handed is needed).
        acted = [t for e in self.actions for t in tensors_of(e.value)]
        self.handed = [e.value for e in self.sums.values()] + acted
        roots = [t.op for t in results + acted] + self._effects()
        self.needed = self._needed(roots)
        self.ops = graph.get_operations()
        self.made = {op.name: i for i, op in enumerate(self.ops)}
        self.touched = [_touched(graph, action.writes) for action in self.actions]
        handles = set().union(*self.touched)
        self.reads = {op.name: {t.name for t in op.inputs if t.name in handles}
                      for op in self.ops} if handles else {}  # fmt: skip
        ordered = self._in_order()
        self.phase: dict[str, int] = {}
        for op in ordered:
            self.phase[op.name] = self._phase_of(op)
        for k in range(len(self.actions)):
            self._place(k)  # an action after the pass's last op
        count = max([*self.phase.values(), *(o.phase for o in self.actions)]) + 1
        # The needed ops each phase runs, in trace order.
        self.by_phase: list[list[tf.Operation]] = [[] for _ in range(count)]
        for op in ordered:
            if op.name in self.needed and self.kind(op) == "op":
                self.by_phase[self.phase[op.name]].append(op)
        # What each phase gives: what later phases, the sums and the result read.
        wanted = list(results)
        wanted += [e.value for name, e in self.sums.items() if name in self.needed]
        wanted += acted
        for k, ops in enumerate(self.by_phase):
            wanted += [t for op in ops for t in op.inputs if self.phase[t.op.name] != k]
        self.outputs: list[list[str]] = [[] for _ in range(count)]
        given: set[str] = set()
        for tensor in wanted:
            if self.kind(tensor.op) == "op" and tensor.name not in given:
                given.add(tensor.name)
                self.outputs[self.phase[tensor.op.name]].append(tensor.name)
        for meeting in self.sums.values():
            if meeting.result.op.name not in self.needed:
                meeting.phase = -1  # nothing reads it: never summed

    def check_compilable(self) -> None:
        """Raises ``seats.Unserved`` where a value one XLA computation could
        not hand the next crosses between phases: a list a loop keeps for its
        backward pass (a recurrent layer's, when the towers meet between its
        forward and backward passes)."""
        for names in self.outputs:
            for name in names:
                tensor = self.graph.get_tensor_by_name(name)
                if tensor.dtype == tf.variant:
                    raise seats.Unserved(
                        f"{tensor.op.name!r}, a list a loop keeps for its "
                        "backward pass (a recurrent layer's), would cross between "
                        "the XLA computations of a pass cut where the towers meet"
                    )

    def kind(self, op: tf.Operation) -> str:
        """``"fed"`` (an input or a sum's placeholder: the run gives it),
        ``"constant"`` (copied into every phase that reads it) or ``"op"``."""
        if op.name in self.fed or op.name in self.sums:
            return "fed"
        if op.type in _COPIED and not op.inputs:
            return "constant"
        return "op"

    def phase_function(self, k: int, library: Any, jit: bool, inline: bool) -> Phase:
        """Phase ``k``'s ops as one function of the tensors they read from
        elsewhere, giving what the phase gives."""
        nodes, copied, reads = [], set(), []
        for op in self.by_phase[k]:
            node = _without_inputs(op.node_def)
            for tensor in op.inputs:
                source = tensor.op
                if self.kind(source) == "constant":
                    if source.name not in copied:  # a constant waits for nothing
                        copied.add(source.name)
                        nodes.append(_without_inputs(source.node_def))
                elif self.kind(source) == "fed" or self.phase[source.name] != k:
                    if tensor.name not in reads:
                        reads.append(tensor.name)
                node.input.append(_input_name(tensor))
            for control in op.control_inputs:  # earlier phases ran before
                if self.phase[control.name] == k and self.kind(control) == "op":
                    node.input.append(f"^{control.name}")
            nodes.append(node)
        graph_def = tf.compat.v1.GraphDef()
        graph_def.node.extend(nodes)
        graph_def.library.CopyFrom(library)
        outputs = self.outputs[k]
        shapes = [self.graph.get_tensor_by_name(name).shape for name in outputs]

        # The traced graph is dropped once cut, and with it the functions its
        # ops call, unless each phase's graph holds them.
        functions = _runtime.functions_of(self.graph)

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

    def _phase_of(self, op: tf.Operation) -> int:
        if op.name in self.sums:  # after the phase that makes its value
            meeting = self.sums[op.name]
            meeting.phase = self.phase[meeting.value.op.name] + 1
            return meeting.phase
        if self.kind(op) != "op":
            return 0
        if op.type == "Placeholder":
            raise ValueError(
                f"a tower's pass read a placeholder {op.name!r} that is neither "
                "an input nor a sum over the towers"
            )
        before = [self.phase[t.op.name] for t in op.inputs]
        before += [self.phase[c.name] for c in op.control_inputs]
        # After each action met before it that changes what it reads.
        made = self.made[op.name]
        for k, action in enumerate(self.actions):
            if action.made > made:
                break
            if action.writes is None or self._touches(op, self.touched[k]):
                before.append(self._place(k))
        return max(before, default=0)

    def _place(self, k: int) -> int:
        """Action ``k``'s phase, once the ops made before it have theirs:
        after its value, after every needed op made before it that touches
        what it changes (any, when that is not known), and not before the
        action met before it (the actions run in the order met)."""
        action = self.actions[k]
        if action.phase:
            return action.phase
        latest = [self.phase.get(t.op.name, 0) for t in tensors_of(action.value)]
        for op in self.ops[: action.made]:
            if (
                op.name in self.needed
                and self.kind(op) == "op"
                and (action.writes is None or self._touches(op, self.touched[k]))
            ):
                if op.name not in self.phase:  # made before, phased after
                    raise seats.Unserved("the towers' pass reorders its ops")
                latest.append(self.phase[op.name])
        if k:
            latest.append(self._place(k - 1) - 1)
        action.phase = max(latest, default=0) + 1
        return action.phase

    def _touches(self, op: tf.Operation, handles: set[str]) -> bool:
        return bool(handles and self.reads.get(op.name, set()) & handles)

    def _in_order(self) -> list[tf.Operation]:
        """The graph's ops in the order traced, each after what it reads (a
        loop's gradient gives its forward loop inputs made after it: the
        values it keeps for the backward pass), a sum after its value."""
        order: list[tf.Operation] = []
        seen: set[str] = set()
        for first in self.graph.get_operations():
            stack = [(first, False)]
            while stack:
                op, ready = stack.pop()
                if ready:
                    order.append(op)
                    continue
                if op.name in seen:
                    continue
                seen.add(op.name)
                stack.append((op, True))
                reads = [t.op for t in op.inputs] + list(op.control_inputs)
                if op.name in self.sums:
                    reads.append(self.sums[op.name].value.op)
                stack.extend((r, False) for r in reversed(reads) if r.name not in seen)
        return order

    def _effects(self) -> list[tf.Operation]:
        """The ops that run for what they do, whatever reads them (an assert,
        a print, a summary, a stateful draw), as a ``tf.function`` runs every
        stateful op it traced."""
        return [
            op
            for op in self.graph.get_operations()
            if op.op_def.is_stateful and op.type not in _READS and self.kind(op) == "op"
        ]

    def _needed(self, roots: list[tf.Operation]) -> set[str]:
        """The names of the ops the roots need, themselves included: their
        ancestors, through each sum's placeholder to its value."""
        needed: set[str] = set()
        stack = list(roots)
        while stack:
            op = stack.pop()
            if op.name in needed:
                continue
            needed.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
            if op.name in self.sums:
                stack.append(self.sums[op.name].value.op)
        return needed


def _touched(graph: Any, variables: list[Any] | None) -> set[str]:
    """The names of ``graph``'s captured handles of ``variables``."""
    if variables is None:
        return set()
    handles = {id(v.handle) for v in variables}
    return {inner.name for outer, inner in graph.captures if id(outer) in handles}


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

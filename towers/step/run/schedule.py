"""Which phase each op of a tower's pass traced to be cut runs in.

The graph's inputs are phase 0; a sum's placeholder runs one phase after
what made its value; an action (an own step's apply, assignment, metric
update) after its value and after every op before it that touches what it
changes, in the order met; any other op in its inputs' latest phase. A
phase keeps the ops its results need and those that run for what they do
(an assert, a print), as a ``tf.function`` runs every stateful op it traced.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.step.run import seats
from towers.step.run.seats import Action, Sum

# An op of no inputs that is copied into every phase that reads it.
_COPIED = ("Const",)
# Stateful ops that change nothing: run only where a result reads them.
_READS = ("ReadVariableOp", "VarHandleOp", "Placeholder")


def is_tensor(value: Any) -> bool:
    return isinstance(value, tf.Tensor)


def tensors_of(args: Any) -> list[Any]:
    """The tensors of ``args``, composites' parts included, in order; other
    values (None, numbers) are traced as they are."""
    return [a for a in tf.nest.flatten(args, expand_composites=True) if is_tensor(a)]


class Schedule:
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

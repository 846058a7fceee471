"""What a traced value is made of, as the towers compare it: its form
(:func:`form_of`: alike on every tower, or reading a tower's rows or a
draw), whether it reads the batch at all (:class:`Reads`), a shape's entry
as the trace knows it (:func:`static_dim`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from towers._runtime import called_graph


def form_of(
    tensor: Any, batch: Any = (), marks: Any = None, places: Any = None, forms=None
) -> Any:
    """What ``tensor``'s value is made of, as a value every tower's alike shares:
    its ops' types and attributes (constants' values too) down to the inputs
    it reads; None where it reads a tensor of ``batch`` or a draw. ``marks``:
    tensors the towers met for, by meeting; ``places``: a copy's captured
    handle's id -> its place in its copy; ``forms``: what is known already.

    >>> x = tf.constant([1.0, 2.0])
    >>> form_of(x * 2.0) == form_of(x * 2.0), form_of(x * 2.0) == form_of(x * 3.0)
    (True, False)
    """
    if not tf.is_symbolic_tensor(tensor):
        value = np.asarray(tensor)
        return ("value", str(value.dtype), value.shape, value.tobytes())
    leaves = tf.nest.flatten(batch, expand_composites=True)
    batch = {t.ref() for t in leaves if tf.is_tensor(t)}
    marks, places = marks or {}, places or {}
    forms = {} if forms is None else forms
    stack = [tensor]
    while stack:
        t = stack[-1]
        if t.ref() in forms:
            stack.pop()
            continue
        op = t.op
        if t.ref() in batch or "Random" in op.type:
            return None
        leaf = t.ref() in marks or op.type == "Placeholder"
        pending = [] if leaf else [i for i in op.inputs if i.ref() not in forms]
        if pending:
            stack += pending
            continue
        stack.pop()
        if t.ref() in marks:
            forms[t.ref()] = ("met", marks[t.ref()])
        elif op.type == "Placeholder":
            forms[t.ref()] = ("input", places.get(id(t), op.name))
        else:
            attrs = attributes(op)
            inputs = tuple(forms[i.ref()] for i in op.inputs)
            attrs = tuple(sorted(attrs.items()))
            forms[t.ref()] = (op.type, t.value_index, attrs, inputs)
    return forms[tensor.ref()]


@dataclasses.dataclass(frozen=True)
class Form:
    """A value's form (:func:`form_of`) as one leaf of what a tower hands
    in (a nest keeps it whole)."""

    of: Any


def attributes(op: Any) -> dict:
    """``op``'s attributes as bytes, but TensorFlow's bookkeeping ("_...") and
    the functions it calls (their names are their trace's)."""
    return {k: v.SerializeToString() for k, v in op.node_def.attr.items()
            if not k.startswith("_") and not v.HasField("func")
            and not (v.HasField("list") and v.list.func)}  # fmt: skip


# Ops that read a tensor's shape, not its values, and the ops that call a
# function (a traced layer's call, a tower's pass).
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


class Reads:
    """Whether a traced tensor reads any of ``batch``'s tensors, through the
    functions it calls, by its shape too (``shapes``).

    >>> found = []
    >>> @tf.function
    ... def rows(x):
    ...     positions = tf.range(tf.shape(x)[1])  # the length: a shape
    ...     reads = Reads([x], shapes=False)
    ...     found.extend([reads(positions), reads(tf.cast(x[:, 0], "int32"))])
    ...     return positions
    >>> _ = rows(tf.zeros((2, 3)))
    >>> found
    [False, True]
    """

    def __init__(self, batch: list[Any], shapes: bool = True):
        leaves = tf.nest.flatten(batch, expand_composites=True)
        self.batch = {t.ref() for t in leaves if tf.is_tensor(t)}
        self.shapes = shapes
        self.found: dict[tuple, bool] = {}  # (calls, tensor) -> reads

    def __call__(self, tensor: tf.Tensor) -> bool:
        if not tf.is_symbolic_tensor(tensor):
            return False
        stack = [((), tensor)]  # (the calls it is inside, a tensor)
        while stack:
            calls, t = stack[-1]
            key = (calls, t.ref())
            if key in self.found:
                stack.pop()
                continue
            inputs = self._inputs(calls, t)
            if inputs is None or isinstance(inputs, bool):
                self.found[key] = bool(inputs)
                stack.pop()
                continue
            pending = [i for i in inputs if (i[0], i[1].ref()) not in self.found]
            if pending:
                stack += pending
            else:
                self.found[key] = any(self.found[(c, i.ref())] for c, i in inputs)
                stack.pop()
        return self.found[((), tensor.ref())]

    def _inputs(self, calls: tuple, tensor: tf.Tensor) -> Any:
        # What tensor (inside calls) reads; True or False where known at once.
        op = tensor.op
        if not calls and tensor.ref() in self.batch:
            return True
        if not self.shapes and op.type in SHAPE_OPS:
            return False
        if op.type in CALLS:  # into the function, from the output read
            body = called_graph(op.graph, op.name)
            return [((*calls, op), body.outputs[tensor.value_index])]
        if op.type == "Placeholder" and calls:  # out, to the argument
            call = calls[-1]
            body = called_graph(call.graph, call.name)
            where = [i for i, t in enumerate(body.inputs) if t is tensor]
            return [(calls[:-1], call.inputs[i]) for i in where]
        return [(calls, t) for t in op.inputs]


def static_dim(dim: Any) -> Any:
    """A shape's entry as a number where the trace knows it (through
    ``tf.shape(x)[i]``, which ``tf.get_static_value`` does not read), else itself."""
    if not isinstance(dim, tf.Tensor):
        return tf.compat.dimension_value(dim)
    known = tf.get_static_value(dim)
    if known is not None:
        return int(known)
    op = dim.op
    if op.type != "StridedSlice" or op.get_attr("shrink_axis_mask") != 1:
        return dim
    index, source = tf.get_static_value(op.inputs[1]), op.inputs[0]
    whole = tf.get_static_value(source)  # a shape the trace folded
    if whole is None and source.op.type == "Shape":
        shape = source.op.inputs[0].shape
        whole = None if shape.rank is None else shape.as_list()
    if whole is None or index is None or whole[int(index[0])] is None:
        return dim
    return int(whole[int(index[0])])

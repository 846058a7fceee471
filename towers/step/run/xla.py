"""XLA for the towers: whether they compile, and a tower's work as one XLA call.

``jit_compile`` takes Keras' values (``"auto"`` as Keras' ``compile``
decides; unset, the compiled model's). A tower's pass is one
``tf.function(jit_compile=True)`` on its device, its weights read outside
(an XLA computation reads no other device's variable); cut where the
towers meet, a computation a phase. An op XLA cannot compile fails the
first step before any update: named with ``True``, warned of with ``"auto"``."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import keras
import tensorflow as tf

from towers import _runtime
from towers._keras import layers_of
from towers._runtime import NO_INLINE
from towers.step.run.warm_up import cached_on_disk, queue_warm_up

JitCompile = bool | Literal["auto"] | None


@dataclasses.dataclass(frozen=True)
class Jit:
    """The resolved choice: ``enabled``; ``strict`` (``True`` asked: an op XLA
    cannot compile is an error); ``compiled`` (the compiled model's choice,
    a wish where the step cannot compile, as Keras takes it)."""

    enabled: bool = False
    strict: bool = False
    compiled: bool = dataclasses.field(default=False, repr=False, compare=False)


OFF = Jit()


def resolve(option: JitCompile, model: keras.Model, devices: Sequence[str]) -> Jit:
    """``Towers``' ``jit_compile`` for ``model`` on ``devices``.

    Raises:
      ValueError: an unknown value, or True with a layer that cannot compile.

    Example:
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> resolve("auto", model, ["/cpu:0"]), resolve(True, model, ["/cpu:0"])
      (Jit(enabled=False, strict=False), Jit(enabled=True, strict=True))
    """
    compiled = option is None and getattr(model, "compiled", False)
    if option is None:
        option = model.jit_compile if compiled else "auto"
    if option not in (True, False, "auto") or not isinstance(option, (bool, str)):
        raise ValueError(
            f"jit_compile must be True, False or 'auto'; received {option!r}"
        )
    if option is False:
        return OFF
    refusing = [
        layer.name
        for layer in layers_of(model)
        if not getattr(layer, "supports_jit", True)
    ]
    if option is True:
        if refusing:
            raise ValueError(
                "jit_compile=True needs every layer to compile with XLA; received "
                f"layers that do not (supports_jit=False): {refusing}. Pass "
                "jit_compile=False, or 'auto' to compile where Keras would."
            )
        return Jit(enabled=True, strict=True, compiled=bool(compiled))
    kinds = {tf.DeviceSpec.from_string(d).device_type for d in devices}
    if "CPU" in kinds or _runtime.op_determinism():  # as Keras' "auto"
        return OFF
    if refusing:
        warnings.warn(
            f"jit_compile='auto': layers {refusing} do not support XLA "
            "(supports_jit=False), so the towers run without it",
            stacklevel=4,
        )
        return OFF
    return Jit(enabled=True, strict=False)


def function(
    work: Callable[..., Any], jit: bool, inline: bool = True
) -> Callable[..., Any]:
    """``work`` as a ``tf.function`` (one XLA computation with ``jit``) whose
    result may hold Python values: dataclasses, numbers, variables. Its
    tensors come out of the call; the rest is kept from the trace. Not
    ``inline``: called from a step as a function of its own (``NO_INLINE``).

    >>> double = function(lambda x: {"twice": 2 * x, "note": "kept"}, jit=True)
    >>> out = double(tf.constant(3.0))
    >>> float(out["twice"]), out["note"]
    (6.0, 'kept')
    """
    skeletons: dict[Any, Any] = {}
    first_calls: dict[Any, tuple | None] = {}  # a shape's first call, till queued

    def body(*args: Any) -> list[Any]:
        leaves: list[Any] = []
        skeletons[signature(args)] = split_leaves(work(*args), leaves)
        return leaves

    body.__name__ = getattr(work, "__name__", "tower")  # names the XLA call
    attributes = None if inline else NO_INLINE
    traced = tf.function(
        body, autograph=False, jit_compile=jit, experimental_attributes=attributes
    )

    def call(*args: Any) -> Any:
        leaves = traced(*args)
        key = signature(args)
        if jit and tf.inside_function() and cached_on_disk():
            # A second tower of this shard shape: the first's pass warms up.
            if key in first_calls and first_calls[key] is not None:
                queue_warm_up(traced, *first_calls[key])
                first_calls[key] = None
            first_calls.setdefault(key, (args, leaves[0].op.device if leaves else ""))
        return join_leaves(skeletons[key], iter(leaves))

    return call


def read_weights(model: keras.Model) -> list[tf.Tensor]:
    """Each of ``model``'s weights read once, on the current device."""
    return [tf.identity(v) for v in model.weights]


def uncompilable_error(error: tf.errors.OpError, model: keras.Model) -> str | None:
    """What a failed XLA compilation says, with the layer of each op it could
    not compile; None if ``error`` is not one."""
    message = error.message
    if "XLA" not in message or "compile" not in message.lower():
        return None
    ops = re.findall(r"(\w+) \(No registered '\w+' OpKernel for XLA_", message)
    nodes = re.findall(r"\{\{node ([^}]+)\}\}", message)
    names = [layer.name for layer in layers_of(model)]
    layers = []
    for node in nodes:
        layer = _layer_of(node, names)
        if layer is not None and layer not in layers:
            layers.append(layer)
    if not layers and not ops:
        return None
    where = f"layers {layers}" if layers else "the model"
    kinds = f" (ops {sorted(set(ops))})" if ops else ""
    return f"XLA cannot compile {where}{kinds}"


def after_failure(jit: Jit, error: tf.errors.OpError, model: keras.Model) -> Jit:
    """What a step whose call failed with ``error`` runs with next: without XLA
    (warned) where "auto" chose it and XLA could not compile.

    Raises:
      ValueError: ``jit_compile=True``, naming the layers; else ``error``."""
    found = uncompilable_error(error, model) if jit.enabled else None
    if found is None:
        raise error
    if jit.strict:
        raise ValueError(
            f"jit_compile=True: {found}; received a model with them. Pass "
            "jit_compile=False, or 'auto' to run without XLA where it cannot "
            "compile."
        ) from None
    warnings.warn(
        f"jit_compile='auto': {found}, so the towers run without XLA", stacklevel=4
    )
    return OFF


def refuse_uncut(jit: Jit, why: str) -> None:
    """A pass that cannot be cut into XLA computations (``why``) runs in turns
    without XLA: an error for ``jit_compile=True``, a warning for ``"auto"``."""
    if jit.strict:
        raise ValueError(
            f"jit_compile=True: {why}; received a model whose pass XLA cannot "
            "run cut so. Use jit_compile=False (or 'auto')."
        )
    if jit.enabled:
        without(why)


def without(why: str) -> Jit:
    """No XLA, for a step "auto" compiled but cannot: warned of, ``why``."""
    warnings.warn(
        f"jit_compile='auto': {why}, so the towers run without XLA", stacklevel=4
    )
    return OFF


def _layer_of(node: str, names: list[str]) -> str | None:
    # The innermost layer whose scope holds node (a suffixed scope's exact name first).
    scopes = node.split("/")[:-1]
    for scope in reversed(scopes):
        if scope in names:
            return scope
        unsuffixed = re.sub(r"_\d+$", "", scope)
        if unsuffixed in names:
            return unsuffixed
    return None


def signature(args: Any) -> tuple:
    """What tells a call's trace apart: each tensor's shape and dtype (a
    sparse or ragged one's type spec), and every other value as it is."""
    return tuple(
        (tuple(a.shape), a.dtype)
        if isinstance(a, tf.Tensor)
        else tf.type_spec_from_value(a)
        if isinstance(a, (tf.SparseTensor, tf.RaggedTensor))
        else repr(a)
        for a in tf.nest.flatten(args)
    )


class _Leaf:
    """Where a tensor of a result was."""


LEAF = _Leaf()


def split_leaves(obj: Any, leaves: list[Any]) -> Any:
    """``obj`` with each tensor replaced by ``LEAF`` and appended to ``leaves``
    (a ragged or sparse one too: a function returns it whole)."""
    if isinstance(obj, (tf.Tensor, tf.IndexedSlices, tf.RaggedTensor, tf.SparseTensor)):
        leaves.append(obj)
        return LEAF
    return _map_children(obj, lambda child: split_leaves(child, leaves))


def join_leaves(skeleton: Any, leaves: Any) -> Any:
    """The inverse of :func:`split_leaves`: each ``LEAF`` replaced by the next leaf."""
    if skeleton is LEAF:
        return next(leaves)
    return _map_children(skeleton, lambda child: join_leaves(child, leaves))


def _map_children(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to each of its parts (a dataclass's fields, a
    dict's values, a list's or tuple's items); anything else as it is."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(obj, **{n: fn(getattr(obj, n)) for n in fields})
    if isinstance(obj, dict):
        return {key: fn(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [fn(item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj

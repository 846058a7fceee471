"""TensorFlow's persistent XLA cache, used: TensorFlow compiles a
computation per device, so the first tower of each shard shape compiles its
pass once, on zeros, before the step runs (:func:`warm_up`), and every
other tower loads it from the cache.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from towers._keras.current import IDLE, TracedStep, setting, this_tower

_READS = {"ReadVariableOp", "VarHandleOp"}  # the stateful ops a warm-up may run


def cached_on_disk() -> bool:
    """Whether TensorFlow's persistent XLA cache is on (``TF_XLA_FLAGS``)."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    return "tf_xla_persistent_cache_directory=" in flags


def warm_up(function: Any, *args: Any) -> None:
    """Traces ``function`` for ``args`` (a ``tf.function``) and runs the
    warm-ups its trace queued; nothing unless the cache is on."""
    if not cached_on_disk() or not hasattr(function, "get_concrete_function"):
        return
    queued: list = []
    with setting(step=TracedStep(warm_ups=queued)):
        function.get_concrete_function(*args)
    for run in queued:
        run()


def queue_warm_up(traced: Any, args: tuple, device: str) -> None:
    """Queues ``traced``'s run on zeros shaped as ``args``, on ``device``, for
    the :func:`warm_up` tracing the step; not if none does, the pass holds a
    stateful op other than a variable's read (an assignment, a stateful draw)
    or an argument's shape is not known."""
    queue = (this_tower().step or IDLE).warm_ups
    if queue is None:
        return
    concrete = traced.get_concrete_function(*args)
    ops = concrete.graph.get_operations()
    if {op.type for op in ops if op.op_def.is_stateful} - _READS:
        return
    flat = [a for a in tf.nest.flatten(args) if tf.is_tensor(a)]
    if not all(
        a.shape.is_fully_defined() and a.dtype.is_numpy_compatible for a in flat
    ):
        return
    specs = tf.nest.map_structure(
        lambda a: tf.TensorSpec(a.shape, a.dtype) if tf.is_tensor(a) else a, args
    )

    @tf.function(autograph=False)
    def call_there(*zeros: Any) -> Any:  # called from a graph, as in the step
        with tf.device(device):
            return concrete(*zeros)  # returned, or TensorFlow prunes the call

    def run() -> None:
        with tf.device(device):
            call_there(*tf.nest.map_structure(_zeros, specs))

    queue.append(run)


def _zeros(spec: Any) -> Any:
    return tf.zeros(spec.shape, spec.dtype) if isinstance(spec, tf.TensorSpec) else spec

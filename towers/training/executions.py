"""Several training steps in one call: ``steps_per_execution``.

Keras' fit runs ``steps_per_execution`` batches per call of its compiled
function, a loop in the graph, so a small model's step does not wait for the
host between batches. towers does the same: consecutive batches of one shape
are stacked (``[k, B, ...]``, on the host) and one ``tf.function`` runs the
step on each in a ``tf.while_loop``, each iteration the whole step of
``towers/step/step.py`` (split, towers, combine, apply, metrics), in order, as
k calls would. The loop stops at a step whose gradient is not finite under
``on_nonfinite="raise"`` (nothing after it runs; the engine then raises). A
cluster's stop notice is read after the call: every worker runs the same
steps, so all stop after the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.split import COMPOSITES
from towers.step.batches import HOST


def looped(train: Callable[..., dict]) -> Callable:
    """A function of a stacked run of batches that calls ``train`` (the
    step's ``Step.train``, or a model's own step's) on each, in a loop in the
    graph. It returns what ``train`` returns for the last batch run (its
    logs: the metrics' running values and that batch's, as Keras' loop
    returns its last step's), with the workers' stop asked by any step.
    """

    def steps(x: Any, y: Any, sample_weight: Any) -> dict[str, Any]:
        stacked = (x, y, sample_weight)
        count = tf.shape(tf.nest.flatten(x)[0])[0]
        last = _runtime.lazy_optional()  # what train returns: known when traced

        def one(i, outputs, finite, stop):
            batch = tf.nest.map_structure(
                lambda a: None if a is None else tf.gather(a, i), stacked
            )
            out = train(*batch)
            outputs = tf.experimental.Optional.from_value(out)
            _runtime.fix_spec(last, outputs)
            finite = tf.reduce_all(out.get("finite", True))
            stop = tf.maximum(stop, tf.cast(out.get("stop", 0.0), tf.float32))
            return i + 1, outputs, finite, stop

        def going(i, outputs, finite, stop):
            return tf.logical_and(i < count, finite)

        start = (tf.constant(0), last, tf.constant(True), tf.constant(0.0))
        _, outputs, _, stop = tf.while_loop(going, one, start)
        _runtime.fix_spec(outputs, last)
        out = outputs.get_value()
        return {**out, "stop": stop} if "stop" in out else out

    return steps


def runs(batches: list[tuple]) -> list[list[tuple]]:
    """``batches`` (prepared ``(x, y, sample_weight)``) cut into runs of
    consecutive ones a loop can take stacked: the same structure, shapes and
    dtypes; a sparse or ragged batch is a run of its own.

    >>> a, b = (tf.ones([2, 3]), None, None), (tf.ones([1, 3]), None, None)
    >>> [len(run) for run in runs([a, a, b, a])]
    [2, 1, 1]
    """
    cut: list[list[tuple]] = []
    for batch in batches:
        if cut and stackable(batch) and _signature(cut[-1][-1]) == _signature(batch):
            cut[-1].append(batch)
        else:
            cut.append([batch])
    return cut


def stack(run: list[tuple]) -> tuple:
    """A run's batches stacked on a new first axis, on the host."""
    with tf.device(HOST):
        return tf.nest.map_structure(
            lambda *parts: None if parts[0] is None else tf.stack(parts), *run
        )


def any_count(function: Any) -> Callable[..., Any]:
    """``function`` (a ``tf.function`` of stacked runs) traced once per shape
    of batch: each call's leading axis (the run's length) relaxed to None."""
    concrete: dict[str, Any] = {}

    def traced(*stacked: Any) -> Any:
        specs = tf.nest.map_structure(
            lambda a: (
                None if a is None else tf.TensorSpec([None, *a.shape[1:]], a.dtype)
            ),
            stacked,
        )
        key = repr(specs)
        if key not in concrete:
            concrete[key] = function.get_concrete_function(*specs)
        return concrete[key]

    def call(*stacked: Any) -> Any:
        return traced(*stacked)(*stacked)

    call.traced = traced  # the trace for these stacked batches, made if new
    return call


def stackable(batch: tuple) -> bool:
    """Whether a batch can be stacked with others (no sparse or ragged part)."""
    leaves = [leaf for leaf in tf.nest.flatten(batch) if leaf is not None]
    return not any(isinstance(leaf, COMPOSITES) for leaf in leaves)


def _signature(batch: tuple) -> Any:
    structure = tf.nest.map_structure(
        lambda a: None if a is None else (tuple(a.shape), a.dtype.name), batch
    )
    return repr(structure)

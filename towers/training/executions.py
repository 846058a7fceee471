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

from towers.split import COMPOSITES
from towers.step.batches import HOST


def looped(train: Callable[..., dict], results: Callable[[], dict]) -> Callable:
    """A function of a stacked run of batches that calls ``train`` (the
    step's ``Step.train``) on each, in a loop in the graph. It returns what
    ``train`` returns for the last batch run, its ``"logs"`` being the
    metrics' running values (``results()``) with that batch's loss.
    """

    def steps(x: Any, y: Any, sample_weight: Any) -> dict[str, Any]:
        stacked = (x, y, sample_weight)
        count = tf.shape(tf.nest.flatten(x)[0])[0]
        checks = {"finite": None, "stop": None}

        def one(i, loss, finite, stop):
            batch = tf.nest.map_structure(
                lambda a: None if a is None else tf.gather(a, i), stacked
            )
            out = train(*batch)
            checks["finite"] = "finite" in out
            checks["stop"] = "stop" in out
            finite = out.get("finite", finite)
            stop = tf.maximum(stop, tf.cast(out.get("stop", 0.0), tf.float32))
            return i + 1, tf.cast(out["logs"]["loss"], tf.float32), finite, stop

        def going(i, loss, finite, stop):
            return tf.logical_and(i < count, tf.reduce_all(finite))

        start = (tf.constant(0), tf.constant(0.0), tf.ones([0], tf.bool), 0.0)
        _, loss, finite, stop = tf.while_loop(
            going,
            one,
            start,
            shape_invariants=(
                tf.TensorShape([]),
                tf.TensorShape([]),
                tf.TensorShape([None]),
                tf.TensorShape([]),
            ),
        )
        out = {"logs": {**results(), "loss": loss}}
        if checks["finite"]:
            out["finite"] = finite
        if checks["stop"]:
            out["stop"] = stop
        return out

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

    def call(*stacked: Any) -> Any:
        specs = tf.nest.map_structure(
            lambda a: (
                None if a is None else tf.TensorSpec([None, *a.shape[1:]], a.dtype)
            ),
            stacked,
        )
        key = repr(specs)
        if key not in concrete:
            concrete[key] = function.get_concrete_function(*specs)
        return concrete[key](*stacked)

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

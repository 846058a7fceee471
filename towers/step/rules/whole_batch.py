"""A model's own ``compute_loss`` that couples the batch's examples (CLIP's,
SigLIP's, SimCLR's), computed on the whole batch's outputs.

Every tower hands in its ``x``, ``y``, ``y_pred`` and ``sample_weight`` and
takes everyone's, in example order. With ``L`` the gathered batch's loss and
``w_t = n_t / B``, a tower's term is ``L_t - (1 - w_t) L_s``: ``L_t`` with
only its own outputs live (its gradient flows through its rows), ``L_s``
with all stopped (what the loss reads directly counts once). The terms add
up to ``L``. In a cluster the rows are gathered over the workers too."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import ReadScope, compute_loss
from towers._keras.current import Seat, setting, this_tower
from towers._keras.patches import routed_calls
from towers.combine import in_dtype
from towers.split import batch_size_of
from towers.step.rules.assignments import quiet
from towers.step.rules.metric_updates import met_for
from towers.step.run import seats

LOG2 = 0.6931471805599453  # ln 2


def gathered_loss(
    model: keras.Model,
    batch: tuple[Any, Any, Any, Any],
    share: tf.Tensor,
    scope: ReadScope,
    training: bool,
) -> tf.Tensor:
    """Tower ``t``'s term of the whole batch's ``compute_loss`` (its share ``w_t``)."""
    seat = seats.current()
    x, y, y_pred, sample_weight = batch
    handed = (x, y, _stopped(y_pred), sample_weight)
    rows = gathered_rows(seat, handed)
    x, y, stopped, sample_weight = (_rows_unknown(part) for part in rows.parts)
    live = _rows_unknown(rows.with_own(2, y_pred))
    # In a model's own step every tower's updates meet (assignments.py): what
    # the loss updates from the batch's outputs is the same on every tower.
    own_step = seats.current().own
    for tensor, theirs in zip(
        _leaves(live) if own_step else [], _leaves(rows.first[2])
    ):
        met_for([tensor], theirs.ref())
    first = seat.first and (seat.worker is None or seat.worker[0] == 0)
    with contextlib.nullcontext() if first or own_step else scope.forgetting():
        loss = compute_loss(model, x, y, live, sample_weight, training)
    share = in_dtype(share, loss.dtype)  # a float64 model's digits
    if not training:
        return loss * share
    with scope.forgetting():
        direct = compute_loss(model, x, y, stopped, sample_weight, training)
    return in_dtype(rows.scale, loss.dtype) * (loss - direct) + share * direct


@contextlib.contextmanager
def whole_batch_loss(models: list[keras.Model]) -> Iterator[None]:
    """Within, a ``compute_loss`` called in a model's own step is the whole
    batch's: its term over ``w_t`` (the apply weighs it by ``w_t`` again); its
    second computation (``L_s``) quiet.

    Raises:
      ValueError: with a copy per tower."""

    def route(model: keras.Model, own: Any, args: tuple, kwargs: dict) -> Any:
        here = seats.current()
        if not here.own or this_tower().in_loss:  # its own calls pass through
            return own(*args, **kwargs)
        if len(models) > 1:
            raise ValueError(
                "a compute_loss that couples the batch's examples, called in the "
                "model's own train_step, is computed on the whole batch with one "
                "shared model; received a copy per tower. Nothing was updated."
            )
        call = inspect.signature(own).bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        batch = tuple(given.get(k) for k in ("x", "y", "y_pred", "sample_weight"))
        with setting(in_loss=True):
            term = gathered_loss(
                model, batch, here.weight, _Quiet(), given.get("training", True)
            )
        return tf.math.divide_no_nan(term, in_dtype(here.weight, term.dtype))

    with routed_calls(models, "compute_loss", route):
        yield


class _Quiet:
    """A scope for :func:`gathered_loss` in a model's own step: what its
    second computation assigns is dropped on every tower."""

    def forgetting(self) -> Any:
        return quiet()


def _leaves(nest: Any) -> list[Any]:
    return [] if nest is None else tf.nest.flatten(nest)


@dataclasses.dataclass
class Rows:
    """The towers' rows gathered: ``parts``, every tower's (and worker's) in
    example order; ``start``, this tower's first; ``scale``, ``B / B_w`` (0
    for a worker without examples); ``first``, what tower 0 handed in."""

    parts: list[Any]
    start: Any
    scale: Any
    first: tuple

    def with_own(self, i: int, live: Any) -> Any:
        """Part ``i`` with this tower's rows replaced by ``live`` (its own,
        through which its gradient flows)."""
        return _spliced(self.parts[i], live, self.start)


def gathered_rows(seat: Seat, parts: tuple) -> Rows:
    """Every tower's (and worker's) rows of each of ``parts``, in example
    order: the one gather (``towers.gather`` and a coupled ``compute_loss``)."""
    handed = seat.everyone(parts)
    local = [concat_rows([h[i] for h in handed]) for i in range(len(parts))]
    whole, offset, scale = local, 0, 1.0
    if seat.worker is not None:
        whole, offset, scale = _cluster_rows(seat, local)
    rows = [batch_size_of(h[0]) for h in handed[: seat.rank]]
    return Rows(whole, offset + sum(rows), scale, handed[0])


def _cluster_rows(seat: Seat, local: list[Any]) -> tuple:
    # The cluster's batch, this worker's offset, and B / B_w.

    def gather() -> tuple:
        index, workers = seat.worker
        rows = tf.shape(tf.nest.flatten(local[0])[0])[0]
        mine = tf.one_hot(index, workers, dtype=tf.float64) * tf.cast(rows, tf.float64)
        sizes = tf.cast(seat.across(mine, False), tf.int32)
        offset, total = tf.reduce_sum(sizes[:index]), tf.reduce_sum(sizes)

        # Padded to a power of two rows: a collective's key fixes its shapes
        # (seats.SIZE_BUCKETS), so each power takes its own.
        bucket = tf.cast(
            tf.math.ceil(tf.math.log(tf.cast(tf.maximum(total, 1), tf.float64)) / LOG2),
            tf.int32,
        )
        capacity = tf.bitwise.left_shift(1, bucket)

        def spread(leaf: tf.Tensor) -> tf.Tensor:
            value = leaf if leaf.dtype.is_floating else tf.cast(leaf, tf.float64)
            pads = [[offset, capacity - offset - rows]]
            pads += [[0, 0]] * (leaf.shape.rank - 1)
            summed = seat.across(tf.pad(value, pads), False, bucket)
            return tf.cast(summed[:total], leaf.dtype)

        whole = [
            None if part is None else tf.nest.map_structure(spread, part)
            for part in local
        ]
        return (
            whole,
            offset,
            tf.math.divide_no_nan(
                tf.cast(total, tf.float64), tf.cast(rows, tf.float64)
            ),
        )

    return seat.from_first(gather)


def _spliced(stopped: Any, live: Any, start: Any) -> Any:
    """``stopped`` with rows ``start:start + n`` replaced by ``live``'s n."""

    def splice(whole: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        end = start + tf.shape(rows)[0]
        return tf.concat([whole[:start], rows, whole[end:]], axis=0)

    return tf.nest.map_structure(splice, stopped, live)


def concat_rows(parts: list[Any]) -> Any:
    """The towers' nests joined along the examples (None stays None).

    >>> concat_rows([{"a": tf.ones((1, 2))}, {"a": tf.zeros((2, 2))}])["a"].shape
    TensorShape([3, 2])
    """
    if parts[0] is None:
        return None
    return tf.nest.map_structure(_join, *parts)


def _join(*parts: Any) -> Any:
    if parts[0] is None:  # an optional input given none
        return None
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(0, list(parts))
    return tf.concat(parts, axis=0)


def _rows_unknown(nest: Any) -> Any:
    # nest with its batch dimension unknown, as Keras' fit's batches: its
    # per-output trackers weigh a batch by its static size, once there.

    def unknown(value: Any) -> Any:
        if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
            return value
        shape = [None, *value.shape[1:]]
        return tf.compat.v1.placeholder_with_default(value, shape)

    return None if nest is None else tf.nest.map_structure(unknown, nest)


def _stopped(outputs: Any) -> Any:
    return None if outputs is None else tf.nest.map_structure(tf.stop_gradient, outputs)

"""The other workers of a cluster, as one engine meets them.

One member per worker, this worker's variable device, in groups of TensorFlow's
collective runtime (``towers/placement/collective.py``):

- :func:`join_workers`: what a cluster cannot do yet is refused before anything
  starts.
- :meth:`Workers.start_together`: the workers compare the models they built
  (every variable's name, dtype and shape) and take the chief's values.
- :meth:`Workers.step`: each step, the workers sum their locally combined
  gradients, loss, examples and metric changes, weighted by their examples, in
  one collective per bucket: W workers x T towers give one process's update.
- :meth:`Workers.run`: any compiled call; a peer that never comes is named
  (``towers/cluster/faults.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from towers.cluster.cluster import Cluster
from towers.cluster.faults import LostWorkerWatch, raise_if_lost, waiting_notices
from towers.options import refuse_unsupported
from towers.placement.base import Placement
from towers.placement.collective import AllReduce
from towers.reducers import Packed

# Group keys across workers, in the order the script makes the groups, which is
# the same on every worker (local groups count from 1, towers/placement/collective.py).
_cross_worker_keys = itertools.count(100_000)
# Between processes each collective is a round of RPCs (measured on loopback: ~1.9
# ms for 4 KB, 6.4 ms for 2.7 MB), and one group's collectives run one after
# another: the fewer, the better, so a step's tensors go in one large bucket.
CROSS_WORKER_BYTES_PER_PACK = 64 << 20


def join_workers(
    cluster: Cluster | None, placement: Placement, batch_norm: bool, device: str
) -> Workers | None:
    """The engine's link to the other workers, or None for one process.
    ``batch_norm``: the model normalises with each tower's statistics.

    Raises:
      ValueError: what a cluster cannot do yet was asked for with it.

    Example:
      >>> join_workers(None, placement=None, batch_norm=False, device="/cpu:0")
    """
    if cluster is None:
        return None
    refuse_unsupported(
        "a cluster of workers",
        {
            f"placement={placement.name!r}": not placement.joins_clusters,
            "BatchNormalization layers with batch_statistics='tower'": batch_norm,
        },
        "Use placement='central', and batch_statistics='global' with "
        "BatchNormalization, or one process.",
    )
    return Workers(cluster, device)


@dataclasses.dataclass
class Summed:
    """One step's sums over every worker.

    Attributes:
      grads: per variable, the cluster's combined gradient (None stays None).
      loss: the cluster's loss (a mean over all its examples, for a mean loss).
      examples: int32[], the examples of every worker together.
      extras: the summed extras (metric changes), in the order sent.
      stop: float32[], how many workers asked to stop after this step (a
        preemption notice): every worker sees the same count at the same step.
      means: the cluster's value of each of ``means`` sent (per-output
        losses), combined as the loss is.
      state: the part of ``extras`` the step reads as the towers' assigned
        state (``towers/step/rules/state.py``), set by the step.
    """

    grads: list[Any]
    loss: tf.Tensor
    examples: tf.Tensor
    extras: list[tf.Tensor]
    stop: tf.Tensor
    means: list[tf.Tensor] = dataclasses.field(default_factory=list)
    state: list[tf.Tensor] = dataclasses.field(default_factory=list)


class Workers:
    """What this worker exchanges with the others.

    Args:
      cluster: the started cluster.
      device: this worker's variable device, where the sums are made.
      reducer: how the step's tensors are packed; default one bucket of up to
        ``CROSS_WORKER_BYTES_PER_PACK``.
    """

    def __init__(self, cluster: Cluster, device: str, reducer: Any = None):
        reducer = reducer or Packed(CROSS_WORKER_BYTES_PER_PACK)
        self.cluster = cluster
        self.device = device
        size = cluster.num_workers

        def group(dev: str, how: Any, timeout: float) -> AllReduce:
            return AllReduce(
                [dev], how, timeout, group_size=size, group_key=next(_cross_worker_keys)
            )

        self._check = group(
            "/device:CPU:0", "per_tensor", cluster.startup_timeout_seconds
        )
        self._start = group(device, "packed", cluster.startup_timeout_seconds)
        # A lost peer is found by probing (faults.LostWorkerWatch) after
        # timeout_seconds; the collectives' own timeout is the backstop.
        backstop = 2 * cluster.timeout_seconds
        self._watch = LostWorkerWatch(cluster)
        self._agree = group(device, "per_tensor", backstop)
        # Training and evaluation steps send different tensors: a group each, so
        # their instance keys never meet.
        self._groups = {
            kind: group(device, reducer, backstop) for kind in ("train", "eval")
        }
        # The towers' meetings (global statistics, gathered rows, a model's
        # own step): one gather per exchange; a group per kind of step, as
        # above (a collective's key fixes its shapes).
        self._statistics = {
            kind: group(device, "per_tensor", backstop)
            for kind in ("train", "eval", "predict", "draws")
        }
        # 1.0 once this worker was asked to stop (request_stop); rides in every
        # step's sum, so all workers learn of it after the same step.
        with tf.device(device):
            self._stop = tf.Variable(0.0, trainable=False, name="stop_requested")
        # The last train step's Summed.stop (set by the engine), or None.
        self.last_stop: tf.Tensor | None = None

    def request_stop(self) -> None:
        """Asks every worker to stop after the next step (see ``Summed.stop``)."""
        self._stop.assign(1.0)

    def stop_flag(self) -> tf.Tensor:
        """1.0 once this worker was asked to stop (:meth:`request_stop`)."""
        return self._stop.read_value()

    def start_together(self, variables: Sequence[Any]) -> None:
        """Every worker checks it built the chief's model, then takes its values.

        Raises:
          ValueError: on every worker, if the workers' variables differ.
        """
        self.check_same(
            [
                (
                    v.path,
                    v.dtype if isinstance(v.dtype, str) else v.dtype.name,
                    str(tuple(v.shape)),
                )
                for v in variables
            ]
        )
        self.broadcast(variables)

    def sum(self, tensors: Sequence[tf.Tensor], kind: str = "train") -> list:
        """Every worker's ``tensors`` summed (same shapes and order everywhere)."""
        return self._groups[kind].all_reduce([list(tensors)])[0]

    def sum_statistics(
        self, value: tf.Tensor, instance: Any, kind: str = "train"
    ) -> tf.Tensor:
        """Every worker's ``value`` summed: the ``instance``-th exchange of a
        ``kind`` step's meetings (the same order on every worker). Small
        tensors (a few KB: per-channel statistics): gathered, not all-reduced."""
        return self._statistics[kind].gathered_sum([value], instance)[0]

    def first_row(self, examples: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """This worker's first row in the step's global batch (its
        ``examples`` and every other worker's, summed before it), where its
        random draws start, and the global batch's rows
        (``towers/step/rules/places.py``)."""
        size, rank = self.cluster.num_workers, self.cluster.index
        mine = tf.one_hot(rank, size, dtype=tf.float32) * tf.cast(examples, tf.float32)
        every = tf.cast(self.sum_statistics(mine, 0, "draws"), tf.int32)
        return tf.reduce_sum(every[:rank]), tf.reduce_sum(every)

    def step(
        self,
        grads: Sequence[Any],
        loss: tf.Tensor,
        examples: Any,
        extras: Sequence[tf.Tensor],
        weight: Any,
        kind: str = "train",
        means: Sequence[tf.Tensor] = (),
    ) -> Summed:
        """The whole cluster's gradients, loss and examples of one step.

        Each worker's ``grads`` and ``loss`` are over its own ``examples``: means
        (``weight``: the worker's examples) or sums (``weight`` None). Means are
        weighted before the sum and divided by the total weight after, so uneven
        shares give the global batch's mean; so are ``means`` (scalars, like
        the loss). ``extras`` (metric changes) are summed as they are.
        IndexedSlices are sent dense. One collective per bucket carries it all.
        """
        scalars = [tf.reshape(tf.cast(v, tf.float32), [1]) for v in (loss, *means)]
        count = tf.reshape(tf.cast(examples, tf.float32), [1])
        rest = [count, tf.reshape(self._stop.read_value(), [1]), *extras]
        summed, sent = self.weighted_sum([*grads, *scalars], weight, kind, rest)
        n = len(grads)
        loss, *means = [value[0] for value in summed[n:]]
        total, stop = tf.cast(sent[0][0], tf.int32), sent[1][0]
        return Summed(summed[:n], loss, total, sent[2:], stop, means)

    def weighted_sum(
        self, tensors: Sequence[Any], weight: Any, kind: str = "train",
        extras: Sequence[tf.Tensor] = (), first: int = 0,
    ) -> tuple[list, list]:  # fmt: skip
        """Every worker's ``tensors`` summed: each worker's times its
        ``weight`` (its examples) and the sum divided by the weights' (the
        cluster's mean, weighted by examples; a worker of weight 0 adds 0
        whatever its values), or as they are (``weight`` None: a sum's);
        ``extras`` summed as they are. One collective per bucket, its instance
        keys from ``first``; IndexedSlices sent dense (every worker sends the
        same shapes). Returns the sums (None where a tensor is) and the extras'."""
        scale = tf.constant(1.0) if weight is None else tf.cast(weight, tf.float32)
        send = [tf.convert_to_tensor(t) for t in tensors if t is not None]
        send = [tf.math.multiply_no_nan(t, tf.cast(scale, t.dtype)) for t in send]
        n = len(send)
        packed = [*send, tf.reshape(scale, [1]), *extras]
        summed = self._groups[kind].all_reduce([packed], first)[0]
        norm = tf.constant(1.0) if weight is None else summed[n][0]
        out = iter(t / tf.cast(norm, t.dtype) for t in summed[:n])
        return [None if t is None else next(out) for t in tensors], summed[n + 1 :]

    def check_same(self, description: Sequence[tuple[str, str, str]]) -> None:
        """Raises on every worker if the workers' models differ.

        ``description``: one ``(name, dtype, shape)`` per variable, in order. Each
        worker's is gathered (its length first, then the padded bytes), so the
        collectives have the same shapes everywhere even when models differ: this
        never deadlocks on a mismatch.
        """
        mine = json.dumps([list(d) for d in description]).encode()
        size, rank = self.cluster.num_workers, self.cluster.index
        lengths = self._gather([len(mine)], size, rank, instance=0)
        longest = int(max(lengths[:, 0]))
        padded = list(mine) + [0] * (longest - len(mine))
        rows = self._gather(padded, size, rank, instance=1)
        theirs = [
            json.loads(bytes(int(c) for c in row[: int(n)]).decode())
            for row, n in zip(rows, lengths[:, 0])
        ]
        for other, model in enumerate(theirs):
            if other != rank and model != json.loads(mine):
                raise ValueError(
                    "the workers must build the same model; received "
                    + _first_difference(json.loads(mine), rank, model, other)
                )

    def _gather(self, row: list[int], size: int, rank: int, instance: int):
        """Rows of every worker, stacked in rank order (a sum of one-hot rows)."""
        spread = tf.scatter_nd([[rank]], tf.constant([row], tf.int32), [size, len(row)])
        return self.call(lambda: self._check.all_reduce([[spread]], instance)[0][0])

    def agree(self, value: int) -> int:
        """The chief's ``value`` (an integer below 2**53, e.g. a seed), on every
        worker."""
        chief = self.cluster.is_chief
        mine = tf.constant(float(value) if chief else 0.0, tf.float64)
        total = self.run(tf.function(lambda: self._agree.all_reduce([[mine]])[0][0]))
        return int(total.numpy())

    def broadcast(self, variables: Sequence[tf.Variable]) -> None:
        """Sets ``variables`` to the chief's values on every worker."""
        chief = self.cluster.is_chief

        def exchange():
            values = [
                tf.convert_to_tensor(v) if chief else tf.zeros(v.shape, v.dtype)
                for v in variables
            ]
            sums = self._start.all_reduce([values])[0]
            for var, value in zip(variables, sums):
                var.assign(value)

        if variables:
            self.call(exchange)

    def run(self, step: Callable[..., Any], *args: Any, startup: bool = False) -> Any:
        """``step(*args)``; a collective that failed for want of a peer raises
        ``WorkerLostError`` naming it. ``startup``: the first collectives, where
        the workers wait for each other to start: while they wait, this worker
        says which peers it is waiting for (``faults.waiting_notices``)."""
        started = time.monotonic()
        notices = waiting_notices(self.cluster) if startup else self._watch.step()
        try:
            with notices:
                return step(*args)
        except tf.errors.OpError as error:
            raise_if_lost(self.cluster, error, time.monotonic() - started, startup)
            raise

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` as a tf.function, one of the start's collectives (see
        :meth:`run`); results as NumPy."""
        result = self.run(tf.function(fn), startup=True)
        return tf.nest.map_structure(
            lambda t: t.numpy() if hasattr(t, "numpy") else t, result
        )


def _first_difference(mine: list, rank: int, theirs: list, other: int) -> str:
    if len(mine) != len(theirs):
        return (
            f"{len(mine)} variables on worker {rank} and {len(theirs)} on worker "
            f"{other}"
        )
    for (name, dtype, shape), (o_name, o_dtype, o_shape) in zip(mine, theirs):
        if (name, dtype, shape) != (o_name, o_dtype, o_shape):
            return (
                f"{name!r} {dtype} {shape} on worker {rank} where worker {other} has "
                f"{o_name!r} {o_dtype} {o_shape}"
            )
    return "different models"  # pragma: no cover - lists differ somewhere

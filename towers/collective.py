"""All-reduce on TensorFlow's collective runtime (the ops MultiWorkerMirroredStrategy
uses): across the tower devices of this process (the replicated placement) and
across the worker processes of a cluster (``WorkerReduce``).

One ``CollectiveReduceV2`` op per member device joins a group of all of them; they
meet, sum, and each gets the same result (a ring on CPUs, NCCL on GPUs when
TensorFlow chooses it). Keys are fixed when the engine is made: group key per
group, instance key per tensor position, so retracing a step makes the same ops
with the same keys. Across workers the keys come from a counter of their own, so
identical scripts make identical keys on every worker.

Each device also needs an *ordering token* (a resource on that device): without
one, TensorFlow treats the ops as stateless and the group never assembles.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from towers.reducers import Packed, PerTensor, buckets, get_reducer

if TYPE_CHECKING:
    from towers.cluster import Cluster

# Group keys: each AllReduce takes its own. Groups within one process count from
# 1; groups across workers from _CROSS_WORKER_KEYS, in the order the script makes
# them, which is the same on every worker.
_group_keys = itertools.count(1)
_cross_worker_keys = itertools.count(100_000)
# Instance keys of one group: one per packed bucket or tensor.
_INSTANCES_PER_GROUP = 10_000
# Between processes each collective is a round of RPCs (measured on loopback: ~1.9
# ms for 4 KB, 6.4 ms for 2.7 MB), and one group's collectives run one after
# another: the fewer, the better, so a step's tensors go in one large bucket.
CROSS_WORKER_BYTES_PER_PACK = 64 << 20


class AllReduce:
    """Sums tensors across ``devices``: every device gets the sum.

    Args:
      devices: one device per member, e.g. the towers' devices.
      reducer: ``"per_tensor"`` (one collective per tensor) or ``"packed"`` (one per
        bucket of ``bytes_per_pack``); see ``towers/reducers.py``.
      timeout_seconds: how long a member waits for the others (0: forever).
      group_size: members in the whole group; default ``len(devices)``. Across
        workers, each process gives its own member and the group spans them all.
      group_key: the group's key (the same in every process of the group);
        default a fresh local one.

    Example:
      >>> import tensorflow as tf
      >>> ring = AllReduce(["/cpu:0", "/cpu:1"])
      >>> @tf.function
      ... def total():
      ...     return ring.all_reduce([[tf.constant([1.0])], [tf.constant([2.0])]])
      >>> [[t.numpy().tolist() for t in member] for member in total()]
      [[[3.0]], [[3.0]]]
    """

    def __init__(
        self,
        devices: Sequence[str],
        reducer: Any = "per_tensor",
        timeout_seconds: float = 0.0,
        group_size: int | None = None,
        group_key: int | None = None,
    ):
        self.devices = list(devices)
        self.group_size = len(self.devices) if group_size is None else group_size
        self.reducer = get_reducer(reducer)
        if type(self.reducer) not in (PerTensor, Packed) or self.reducer.wire_dtype:
            # Sharded: a ring all-reduce already is a reduce-scatter and a gather.
            # A 16-bit cast would also sum in 16 bits inside the collective.
            raise ValueError(
                "an all-reduce takes the 'per_tensor' or 'packed' reducer; received "
                f"{self.reducer.name!r}"
            )
        self.timeout_seconds = float(timeout_seconds)
        self.group_key = next(_group_keys) if group_key is None else group_key
        self._tokens = []
        for device in self.devices:
            with tf.device(device):
                self._tokens.append(tf.Variable(0.0, trainable=False))

    def all_reduce(
        self, per_member: Sequence[Sequence[tf.Tensor]], first_instance: int = 0
    ) -> list[list]:
        """``per_member[m][i]``: member m's i-th tensor; returns each member's sums.

        Every member must give tensors of the same shapes and dtypes, in the same
        order. Collectives of other shapes in the same group need instance keys of
        their own: start them at ``first_instance``.
        """
        num = len(self.devices)
        if len(per_member) != num:
            raise ValueError(
                f"all_reduce needs one list per device ({num}); received "
                f"{len(per_member)}"
            )
        # per_tensor[i][m]: the shape the reducers' bucketing takes.
        per_tensor = [list(column) for column in zip(*per_member)]
        groups = self._buckets(per_tensor)
        sums: list[list[Any]] = [[None] * len(per_tensor) for _ in range(num)]
        for instance, bucket in enumerate(groups):
            packed = [self._pack(per_tensor, bucket, m) for m in range(num)]
            reduced = [
                self._reduce(packed[m], m, first_instance + instance)
                for m in range(num)
            ]
            for m in range(num):
                with tf.device(self.devices[m]):
                    pieces = self._unpack(reduced[m], per_tensor, bucket)
                    for i, piece in zip(bucket, pieces):
                        sums[m][i] = piece
        return sums

    def _buckets(self, per_tensor: list[list[tf.Tensor]]) -> list[list[int]]:
        if isinstance(self.reducer, Packed):
            return buckets(per_tensor, self.reducer.bytes_per_pack)
        return [[i] for i in range(len(per_tensor))]

    def _pack(self, per_tensor, bucket: list[int], m: int) -> tf.Tensor:
        with tf.device(self.devices[m]):
            if len(bucket) == 1:
                packed = per_tensor[bucket[0]][m]
            else:
                flat = [tf.reshape(per_tensor[i][m], [-1]) for i in bucket]
                packed = tf.concat(flat, 0)
            return packed

    def _reduce(self, tensor: tf.Tensor, m: int, instance: int) -> tf.Tensor:
        if instance >= _INSTANCES_PER_GROUP:
            raise ValueError(
                f"one all-reduce group takes at most {_INSTANCES_PER_GROUP} tensors "
                f"per step; received more. Use reducer='packed'."
            )
        with tf.device(self.devices[m]):
            return tf.raw_ops.CollectiveReduceV2(
                input=tensor,
                group_size=self.group_size,
                group_key=self.group_key,
                instance_key=self.group_key * _INSTANCES_PER_GROUP + instance,
                ordering_token=[self._tokens[m].handle],
                merge_op="Add",
                final_op="Id",
                timeout_seconds=self.timeout_seconds,
            )

    def _unpack(self, total: tf.Tensor, per_tensor, bucket: list[int]) -> list:
        if len(bucket) == 1:
            return [total]
        sizes = [per_tensor[i][0].shape.num_elements() for i in bucket]
        pieces = tf.split(total, sizes)
        return [tf.reshape(p, per_tensor[i][0].shape) for p, i in zip(pieces, bucket)]


class WorkerReduce:
    """What the engine exchanges with the other workers of a cluster.

    One member per worker: this worker's variable device. At start, the workers
    compare their models and take the chief's variables; each step, they sum the
    locally combined gradients weighted by their examples (see :meth:`step`).

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
        # Training and evaluation steps send different tensors: a group each, so
        # their instance keys never meet.
        self._groups = {
            kind: group(device, reducer, cluster.timeout_seconds)
            for kind in ("train", "eval")
        }

    def sum(self, tensors: Sequence[tf.Tensor], kind: str = "train") -> list:
        """Every worker's ``tensors`` summed (same shapes and order everywhere)."""
        return self._groups[kind].all_reduce([list(tensors)])[0]

    def step(
        self,
        grads: Sequence[Any],
        loss: tf.Tensor,
        batch: Any,
        extras: Sequence[tf.Tensor],
        weighted: bool,
        kind: str = "train",
    ):
        """The whole cluster's gradients, loss and examples of one step.

        Each worker's ``grads`` and ``loss`` are over its own ``batch`` examples:
        means (``weighted``) or sums. Means are weighted by ``batch`` before the
        sum and divided by the total after, so uneven shares give the global
        batch's mean. ``extras`` (metric state changes) are summed as they are.
        IndexedSlices are sent dense. One collective per bucket carries it all.

        Returns:
          ``(grads, loss, total examples (int32), summed extras)``.
        """
        count = tf.cast(batch, tf.float32)
        weight = count if weighted else tf.constant(1.0)
        # IndexedSlices go dense: every worker must send the same shapes.
        send = [tf.convert_to_tensor(g) for g in grads if g is not None]
        send = [g * tf.cast(weight, g.dtype) for g in send]
        n = len(send)
        summed = self.sum(
            [*send, tf.reshape(loss * weight, [1]), tf.reshape(count, [1]), *extras],
            kind,
        )
        loss_sum, total = summed[n][0], summed[n + 1][0]
        norm = total if weighted else tf.constant(1.0)
        out = iter(g / tf.cast(norm, g.dtype) for g in summed[:n])
        combined = [None if g is None else next(out) for g in grads]
        return combined, loss_sum / norm, tf.cast(total, tf.int32), summed[n + 2 :]

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
        return self.cluster_call(
            lambda: self._check.all_reduce([[spread]], instance)[0][0]
        )

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
            self.cluster_call(exchange)

    def cluster_call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` as a tf.function; a peer that never comes is named."""
        started = time.monotonic()
        try:
            result = tf.function(fn)()
        except tf.errors.OpError as error:
            raise_if_lost(self.cluster, error, time.monotonic() - started)
            raise
        return tf.nest.map_structure(
            lambda t: t.numpy() if hasattr(t, "numpy") else t, result
        )


def raise_if_lost(cluster: Cluster, error: Exception, waited: float) -> None:
    """Turns a collective that failed for want of a peer into WorkerLostError."""
    lost_kinds = (
        tf.errors.DeadlineExceededError,
        tf.errors.UnavailableError,
        tf.errors.AbortedError,
        tf.errors.CancelledError,
    )
    if isinstance(error, lost_kinds) or "timed out" in str(error):
        raise cluster.lost_error(error, waited) from error


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

"""What a model's own step returns, read once every tower has run it: a
metric's result after every tower updated the metric, any other number
weighted by the towers' shares (a sum's, as the probe found it, as a
mean's), in a cluster with the workers' in one packed sum.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import tensorflow as tf

from towers.cluster.workers import Workers
from towers.combine import in_dtype
from towers.placement.base import Placement
from towers.split import Shards, examples_of
from towers.step.rules import loss_kinds
from towers.step.run.seats import Across
from towers.step.work.applies import INSTANCES_PER_APPLY


@dataclasses.dataclass
class Logs:
    """A step's logs as read (:meth:`read`): ``across``, the step's handle
    on the workers (None: no cluster); ``free``, each log's batch-free
    terms, by ref; ``assignments``, which logs are metrics' results;
    ``stop``, after a training step in a cluster, the workers asking to."""

    placement: Placement
    applies: Any
    workers: Workers | None
    across: Across | None
    free: dict
    assignments: Any
    stop: Any = None

    def _as_mean(self, value: Any, share: Any, apart: bool) -> tf.Tensor:
        """A number the step returns that sums over the tower's rows, as a
        mean's: its batch-free terms apart (``apart``), over the tower's share
        of the (in a cluster, global) batch."""
        value = tf.convert_to_tensor(value)
        if self.across is not None:
            worker = in_dtype(self.across.weight, value.dtype)
            share = in_dtype(share, value.dtype) * worker
        free = self.free.get(value.ref()) if apart else None
        return loss_kinds.as_mean([value], [free], share)[0]

    def read(
        self, logs: list[Any], shards: Shards, kinds: dict, before: Any, training: bool
    ) -> Any:
        """The step's logs: a metric's result (a value the step read from a
        metric's ``result()``, under its name; with a copy per tower, any
        value under a metric's name) read after every tower updated it; any
        other value weighted by the towers' shares, a sum's (by ``kinds``,
        the probe's) as a mean's. A dict of them (Keras' ``"compile_metrics"``)
        is read alike, entry by entry. In a cluster they meet the workers'
        (:meth:`_over_workers`; ``before``: the metrics' snapshot)."""
        working = self.placement.working_towers(shards)
        numbers: list[tf.Tensor] = []  # this worker's, each tower's weighted

        def mine(key: str, values: list[Any]) -> Any:  # each tower's, in order
            value = values[-1]
            if isinstance(value, dict):
                return {k: mine(k, [v[k] for v in values]) for k in value}
            if not is_float(value):
                return value
            parts = []
            for part, t in zip(values, working):
                weight = share(shards, t)
                kind = kinds.get(key, "mean")
                if kind != "mean" and self.applies.as_mean(part) is part:
                    part = self._as_mean(part, weight, kind == "sum")
                part = tf.convert_to_tensor(self.applies.as_mean(part))
                parts.append(part * in_dtype(weight, part.dtype))
            numbers.append(tf.add_n(parts))
            return _Number(len(numbers) - 1, key, value)

        last = logs[-1]
        if isinstance(last, dict):
            last = {k: mine(k, [log[k] for log in logs]) for k in last}
        numbers = self._over_workers(before, numbers, training)
        results = {}
        with tf.device(self.placement.variable_device):
            for metric in self.placement.model.metrics:
                result = metric.result()
                if isinstance(result, dict):
                    results.update(result)
                else:
                    results[metric.name] = result

        def read(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: read(v) for k, v in value.items()}
            if not isinstance(value, _Number):
                return value
            result = self.assignments.is_result(value.value) is not False
            return results[value.key] if value.key in results and result else (
                numbers[value.index])  # fmt: skip

        return read(last)

    def _over_workers(self, before: Any, numbers: list, training: bool) -> list:
        """In a cluster, in one packed sum: every worker's metric changes
        since ``before`` set (a worker without examples adds none), its
        ``numbers`` weighted by ``B_w / B`` summed and returned, and after
        training the workers asking to stop (:meth:`stop`)."""
        if before is None:
            return numbers
        weight = self.across.weight
        stop = [tf.reshape(self.workers.stop_flag(), [1])] if training else []
        with tf.device(self.placement.variable_device):
            deltas = before.deltas()
            kept = [(d, weight > 0) for d in deltas] + [(n, weight) for n in numbers]
            sent = [tf.math.multiply_no_nan(t, in_dtype(w, t.dtype)) for t, w in kept]
            first = len(self.applies.names) * INSTANCES_PER_APPLY
            kind = "train" if training else "eval"
            _, summed = self.workers.weighted_sum([], None, kind, sent + stop, first)
            before.set(summed[: len(deltas)])
        self.stop = summed[-1][0] if training else None
        return summed[len(deltas) : len(deltas) + len(numbers)]


# A number of the step's logs: its place among the numbers summed, its key
# and the last tower's value (whether it is a metric's result).
_Number = collections.namedtuple("_Number", "index key value")


def share(shards: Shards, t: int) -> Any:
    """Tower ``t``'s share of the step's examples, ``n_t / B``."""
    if shards.sizes is not None and isinstance(shards.size, int):
        return shards.sizes[t] / shards.normaliser  # B, or 1 when empty
    n_t = tf.cast(examples_of(shards.parts[t]), tf.float64)
    return n_t / tf.cast(shards.normaliser, tf.float64)


def is_float(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and tf.as_dtype(dtype).is_floating

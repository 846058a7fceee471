"""What runs after the towers' gradients: once a step for the built-in pass,
and at each ``optimizer.apply`` of a model's own step (``work/applies.py``)::

    tower_grads[t][v] -> combine    the placement's, as one device's where
                                    adding is not (``rules/grad_rules.py``)
                      -> workers    in a cluster, one packed sum weighted by
                                    examples (the step's loss, metrics' and
                                    state's changes with it)
                      -> apply      the Update: accumulation, the non-finite
                                    policy; the moving statistics and the state
                                    the towers assigned (``rules/state.py``)
                      -> metrics    the loss tracker and the compiled metrics
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.cluster.workers import Summed, Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards, batch_size_of
from towers.step.metrics import Metrics
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.rules.grad_rules import combined
from towers.step.rules.state import exchanged, rule_of, settle_apart_metrics


@dataclasses.dataclass
class Tail:
    """The one tail after the towers' gradients; ``assigned``: what the towers'
    passes assign, by variable path: its rule (``towers explain`` lists them)."""

    placement: Placement
    metrics: Metrics
    moving_statistics: MovingStatistics
    workers: Workers | None
    assigned: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.placement.variable_device

    def combine(self, tower_grads: list, batch: Any = None, listed=None) -> list:
        """``tower_grads[t][v]`` combined by the placement, as one device's
        where adding them up is not (``grad_rules.combined``)."""
        return combined(self.placement, tower_grads, batch, listed)

    def sum_losses(self, losses: list[tf.Tensor]) -> tf.Tensor:
        with tf.device(self.device), tf.name_scope("combine"):
            return tf.add_n(losses)

    def apply(self, update: Update, grads: list, tower_variables: list, weight,
              also: Callable[[], None] = lambda: None) -> Any:  # fmt: skip
        """``grads`` applied once by ``update`` (the placement's apply, where
        each variable lives), ``also`` with them; the finiteness flags or None."""
        return self.placement.apply(update, grads, tower_variables, also, weight)

    def apply_met(self, update: Update, tower_grads: list, variables: list,
                  batch: Any, weight: Any, mine: Any, first: int) -> Any:  # fmt: skip
        """An apply a model's own step met: the towers' weighted gradients
        combined, the workers' examples-weighted mean (keys from ``first``),
        applied by ``update``; the finiteness flags or None."""
        with tf.name_scope("combine/"):
            grads = self.combine(tower_grads, batch, variables)
        with tf.device(self.device):
            if self.workers is not None:
                with tf.name_scope("across_workers/"):
                    grads, _ = self.workers.weighted_sum(grads, mine, first=first)
            with tf.name_scope("apply/"):
                return self.apply(update, grads, [variables], weight)

    def across(
        self, before, batch, shards, passes, loss, outputs, grads, weight, kind
    ) -> tuple[list, Summed]:
        """After the built-in step's towers: their state settled, each output's loss
        summed, the metrics updated; in a cluster all of it and ``grads`` every
        worker's, in one packed sum. Returns the settled state and the sums."""
        settled = self.settle(passes, shards)
        named = self._output_losses(outputs)
        with tf.device(self.device), tf.name_scope("metrics"):
            x, y, sample_weight = batch
            self.metrics.update(x, y, [p.predictions for p in passes], sample_weight)
        if self.workers is None:
            summed = Summed(grads, loss, shards.size, [], None, list(named.values()))
            summed.state = None
        else:
            with tf.device(self.device), tf.name_scope("across_workers"):
                deltas, sent = before.deltas(), exchanged(settled)
                summed = self.workers.step(
                    grads, loss, shards.size, [*deltas, *sent], weight, kind,
                    means=list(named.values()),
                )  # fmt: skip
                before.set(summed.extras[: len(deltas)])
                summed.state = summed.extras[len(deltas) :]
        summed.outputs = dict(zip(named, summed.means))
        return settled, summed

    def before(self) -> Any:
        """In a cluster, the metrics as they are before any tower updates one."""
        return None if self.workers is None else self.metrics.snapshot()

    def settle(self, passes: list, shards: Shards, predict=False) -> list:
        """The towers' assigned state, settled by each variable's rule
        (``rules/state.py``), the rules kept in :attr:`assigned`."""
        for tower_pass in passes[:1]:
            self.assigned.update({v.path: rule_of(v) for v in tower_pass.state})
        cluster = None if self.workers is None else self.workers.cluster
        working = shards.working() if predict else self.placement.working_towers(shards)
        sizes = [batch_size_of(shards.parts[t]) for t in working]
        models = self.placement.models
        return settle_apart_metrics(passes, sizes, models, cluster)

    def track(self, summed: Summed, own_loss: bool) -> dict[str, tf.Tensor]:
        """Adds the step's loss (each output's) to its tracker; every metric's value."""
        with tf.device(self.device), tf.name_scope("metrics"):
            outputs = None if own_loss else summed.outputs
            self.metrics.track(summed.loss, summed.examples, outputs)
            return self.metrics.results()

    def _output_losses(self, shares: list[dict]) -> dict[str, tf.Tensor]:
        # Each output's loss this step (the towers' shares summed): what the
        # per-output loss trackers of a model with several outputs take.
        if not shares or not shares[0]:
            return {}
        with tf.device(self.device), tf.name_scope("metrics"):
            return {name: tf.add_n([s[name] for s in shares]) for name in shares[0]}

"""The data path of one step, in the order a batch takes it.

::

    (x, y): B examples on the host
      -> split           Shards: tower t gets n_t examples, sum_t n_t = B
      -> tower t         on devices[t]: loss_t = sum(per-example) / B, grads_t
      -> combine         the placement's: one gradient per variable
      -> across workers  in a cluster: every worker's sums, weighted by examples
      -> apply           once, by the update's policies
      -> metrics         the loss tracker and metrics, from every tower

The engine traces :meth:`Step.train` and :meth:`Step.evaluate` into one
``tf.function`` each. The phases are public so that ``towers bench`` can time
each alone (``towers/bench/phases.py``) on the tensors the step gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.batchnorm import MovingStatistics
from towers.metrics import Metrics
from towers.placement import Placement
from towers.split import Shards, batch_size_of, split_for_towers
from towers.tower import Tower, TowerResult
from towers.update import Update
from towers.workers import Summed, Workers

# Input arrives on the host and is split there, whatever the compute devices are.
HOST = "/device:CPU:0"


class Step:
    """One engine's train and evaluation steps, phase by phase.

    Args:
      placement: where the variables live; combines and applies.
      tower: one tower's work.
      update: the apply's policies, the steps counter.
      metrics: the loss tracker and metrics.
      moving_statistics: BatchNormalization's once-per-step update.
      workers: the other workers of a cluster, or None.
    """

    def __init__(
        self,
        placement: Placement,
        tower: Tower,
        update: Update,
        metrics: Metrics,
        moving_statistics: MovingStatistics,
        workers: Workers | None,
    ):
        self.placement = placement
        self.tower = tower
        self.update = update
        self.metrics = metrics
        self.moving_statistics = moving_statistics
        self.workers = workers
        self.device = placement.variable_device

    def train(self, x: Any, y: Any) -> dict[str, Any]:
        """One training step. Returns ``{"logs": {"loss": the batch's loss,
        metric: value}}``, and ``"finite"`` (per applied gradient) when the
        update checks its gradients."""
        shards = self.split(x, y)
        towers = self.compute(shards)
        loss = self.sum_losses(towers)
        grads = self.combine([r.grads for r in towers])
        examples = shards.size
        if self.workers is None:
            self._update_metrics(y, towers)
        else:
            summed = self._across_workers(grads, loss, shards, y, towers, "train")
            grads, loss, examples = summed.grads, summed.loss, summed.examples
        # Every tower (and every check in it) has finished before any update.
        with tf.control_dependencies([loss]):
            finite = self.apply(grads, [r.moments for r in towers], examples)
        logs = {"loss": loss, **self._track(loss, examples)}
        return {"logs": logs} if finite is None else {"logs": logs, "finite": finite}

    def evaluate(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        """Updates the loss and metrics with one batch; returns their results."""
        shards = self.split(x, y)
        towers = self._each_tower(shards, self.tower.evaluate)
        loss = self.sum_losses(towers)
        examples = shards.size
        if self.workers is None:
            self._update_metrics(y, towers)
        else:
            summed = self._across_workers([], loss, shards, y, towers, "eval")
            loss, examples = summed.loss, summed.examples
        metrics = self._track(loss, examples)
        return {"loss": self.metrics.loss_tracker.result(), **metrics}

    def start(self) -> None:
        """Makes the parts ready once the model has its variables: the
        optimizers' slots, the update's counters, the placement's device checks,
        and in a cluster the chief's values on every worker."""
        self.placement.build_slots()
        self.update.build(self.placement.model.trainable_variables)
        self.placement.check_devices()
        if self.workers is not None:
            self.workers.start_together(self.placement.model.variables)

    def prepare(self, x: Any, y: Any) -> tuple[Any, Any]:
        """Checks a batch and puts it on the host as tensors.

        Raises:
          ValueError: x and y disagree on B, or B == 0 outside a cluster (a
            worker's share of a small batch may be empty: it joins with zeros).
        """
        x_size, y_size = batch_size_of(x), batch_size_of(y)
        if x_size != y_size:
            raise ValueError(
                "x and y must have the same batch size; received x with "
                f"{x_size} examples and y with {y_size}"
            )
        if x_size == 0 and self.workers is None:
            raise ValueError("a batch needs at least one example; received 0")
        with tf.device(HOST):
            return tf.nest.map_structure(tf.convert_to_tensor, (x, y))

    # -- the phases ---------------------------------------------------------------

    def split(self, x: Any, y: Any) -> Shards:
        """The batch cut into the towers' shards, on the host."""
        with tf.device(HOST), tf.name_scope("split"):
            return split_for_towers((x, y), len(self.placement.devices))

    def compute(self, shards: Shards) -> list[TowerResult]:
        """Every working tower's forward and backward pass, on its device."""
        return self._each_tower(shards, self.tower.train)

    def sum_losses(self, towers: list[TowerResult]) -> tf.Tensor:
        """The step's loss: the towers' shares, summed on the variable device."""
        with tf.device(self.device), tf.name_scope("combine"):
            return tf.add_n([r.loss for r in towers])

    def combine(self, tower_grads: list[list[Any]]) -> list[Any]:
        """``tower_grads[t][v]`` combined by the placement."""
        return self.placement.combine(tower_grads)

    def apply(self, grads: list[Any], moments: list[dict], examples: Any):
        """Counts the step and applies ``grads`` (and the moving statistics);
        returns the finiteness flags or None."""
        with tf.name_scope("apply"):
            with tf.device(self.device):
                self.update.count_step()
            return self.placement.apply(
                self.update,
                grads,
                also=lambda: self.moving_statistics.update(moments),
                examples=examples,
                has_regularisers=bool(self.placement.model.losses),
            )

    # -- helpers ------------------------------------------------------------------

    def _each_tower(self, shards: Shards, work: Callable[..., TowerResult]) -> list:
        results = []
        for t in self.placement.working_towers(shards):
            device = self.placement.devices[t]
            with tf.device(device), tf.name_scope(f"tower_{t}"):
                model = self.placement.model_of(t)
                results.append(work(model, *shards.parts[t], shards.normaliser))
        return results

    def _update_metrics(self, y: Any, towers: list[TowerResult]) -> None:
        with tf.device(self.device), tf.name_scope("metrics"):
            self.metrics.update(y, [r.predictions for r in towers])

    def _track(self, loss: tf.Tensor, examples: Any) -> dict[str, tf.Tensor]:
        """Adds the loss to its tracker; returns the metrics' values."""
        with tf.device(self.device), tf.name_scope("metrics"):
            self.metrics.track_loss(loss, examples)
            return self.metrics.results()

    def _across_workers(self, grads, loss, shards, y, towers, kind) -> Summed:
        """This worker's gradients, loss and metric changes summed with every
        other worker's (the metrics then hold the cluster's)."""
        with tf.device(self.device), tf.name_scope("across_workers"):
            changes = self.metrics.update_changes(y, [r.predictions for r in towers])
            summed = self.workers.step(
                grads,
                loss,
                shards.size,
                changes.deltas,
                self.update.normalised_by_batch,
                kind,
            )
            self.metrics.set_changes(changes, summed.extras)
        return summed

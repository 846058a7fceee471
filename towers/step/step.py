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

from towers._keras import trainable_capable
from towers.cluster.workers import Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards, batch_size_of, split_for_towers
from towers.step import lockstep, once, segments
from towers.step.batchnorm import MovingStatistics
from towers.step.losses import normalisation, step_divisors
from towers.step.metrics import Metrics
from towers.step.tower import Tower, TowerResult

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

    def train(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        """One training step. Returns ``{"logs": {"loss": the batch's loss,
        metric: value}}``, ``"finite"`` (per applied gradient) when the update
        checks its gradients, and in a cluster ``"stop"``: how many workers asked
        to stop after this step."""
        shards = self.split(x, y, sample_weight)
        towers = self.compute(shards)
        loss = self.sum_losses(towers)
        grads = self.combine([r.grads for r in towers])
        examples, weight = shards.size, self._weight(towers, shards)
        output_losses = self._output_losses([r.output_losses for r in towers], examples)
        if self.workers is None:
            self._update_metrics(y, sample_weight, towers, output_losses)
        else:
            summed = self._across_workers(
                grads,
                loss,
                weight,
                examples,
                lambda: self._metric_changes(y, sample_weight, towers, output_losses),
                "train",
            )
            grads, loss, examples = summed.grads, summed.loss, summed.examples
            weight = None if weight is None else tf.cast(examples, tf.float32)
            stop = summed.stop
        # Every tower (and every check in it) has finished before any update.
        with tf.control_dependencies([loss]):
            variables = [r.variables for r in towers]
            finite = self.apply(grads, variables, [r.moments for r in towers], weight)
        logs = {"loss": loss, **self._track(loss, examples)}
        out = {"logs": logs} if finite is None else {"logs": logs, "finite": finite}
        if self.workers is not None:
            out["stop"] = stop  # workers that asked to stop after this step
        return out

    def evaluate(
        self, x: Any, y: Any, sample_weight: Any = None
    ) -> dict[str, tf.Tensor]:
        """Updates the loss and metrics with one batch; returns their results."""
        shards = self.split(x, y, sample_weight)
        passes = self._each_tower(shards, self.tower.evaluate)
        divisors = step_divisors([p.terms for p in passes])
        towers = [p.loss(divisors) for p in passes]
        with tf.device(self.device), tf.name_scope("combine"):
            loss = tf.add_n(towers)
        examples = shards.size
        shares = [p.output_losses(divisors) for p in passes]
        output_losses = self._output_losses(shares, examples)
        if self.workers is None:
            self._update_metrics(y, sample_weight, passes, output_losses)
        else:
            weight = self._weight(passes, shards)
            summed = self._across_workers(
                [],
                loss,
                weight,
                examples,
                lambda: self._metric_changes(y, sample_weight, passes, output_losses),
                "eval",
            )
            loss, examples = summed.loss, summed.examples
        metrics = self._track(loss, examples)
        return {"loss": self.metrics.loss_tracker.result(), **metrics}

    def predict(self, x: Any) -> Any:
        """The model's outputs on ``x``: each tower predicts its shard, and the
        shards' outputs are concatenated in tower order."""
        shards = self.split(x, None, None)
        outputs = []
        for t in shards.working():
            with tf.device(self.placement.devices[t]), tf.name_scope(f"tower_{t}"):
                model = self.placement.model_of(t)
                outputs.append(self.tower.predict(model, shards.parts[t][0]))
        with tf.device(HOST):
            return _concat(outputs)

    def start(self) -> None:
        """Makes the parts ready once the model has its variables: the
        optimizers' slots, the update's counters, the placement's device checks,
        and in a cluster the chief's values on every worker."""
        self.placement.build_slots()
        self.update.build(trainable_capable(self.placement.model))
        self.placement.check_devices()
        if self.workers is not None:
            self.workers.start_together(self.placement.model.variables)

    def probe(self, x: Any, y: Any, sample_weight: Any = None) -> None:
        """Before the first training step: the model's loss terms that are not
        a mean over the examples refused by name or warned of
        (``towers/step/coupled.py``); a no-op after."""
        self.tower.coupled.probe(
            self.placement.model,
            (x, y, sample_weight),
            self.tower.own_loss,
            self.device,
        )

    def prepare(self, x: Any, y: Any = None, sample_weight: Any = None) -> tuple:
        """Checks a batch and puts it on the host as tensors.

        Raises:
          ValueError: x, y and sample_weight disagree on B, or B == 0 outside a
            cluster (a worker's share of a small batch may be empty: it joins
            with zeros).
        """
        sizes = {
            name: batch_size_of(part)
            for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight))
            if part is not None
        }
        if len(set(sizes.values())) > 1:
            names = " and ".join(sizes)
            counts = [f"{name} with {n}" for name, n in sizes.items()]
            raise ValueError(
                f"{names} must have the same batch size; received {counts[0]} "
                f"examples and {' and '.join(counts[1:])}"
            )
        if sizes["x"] == 0 and self.workers is None:
            raise ValueError("a batch needs at least one example; received 0")
        if all(_is_tensor_or_none(part) for part in (x, y, sample_weight)):
            return x, y, sample_weight  # what tf.data gives: nothing to convert
        with tf.device(HOST):
            return tf.nest.map_structure(
                lambda a: None if a is None else tf.convert_to_tensor(a),
                (x, y, sample_weight),
            )

    # -- the phases ---------------------------------------------------------------

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """The batch cut into the towers' shards ``(x_t, y_t, sw_t)``, on the host."""
        with tf.device(HOST), tf.name_scope("split"):
            return split_for_towers((x, y, sample_weight), len(self.placement.devices))

    def compute(self, shards: Shards) -> list[TowerResult]:
        """Every working tower's forward pass, the step's divisors, then every
        tower's loss share and gradients, each on its tower's device: traced
        once for every tower when they can share it (``towers/step/once.py``)."""
        working = self.placement.working_towers(shards)
        if self._in_lockstep(working):
            meet = segments.compute if self.tower.jit.enabled else lockstep.compute
            return meet(
                self.placement,
                self.tower,
                shards,
                working,
                self._divisors,
                self.workers,
                lambda passes: self._weight(passes, shards),
            )
        if self.tower.jit.enabled or once.shareable(self.placement, shards, working):
            results = once.compute(
                self.placement, self.tower, shards, working, self._divisors
            )
            if results is not None:
                return results
        passes = self._each_tower(shards, self.tower.forward)
        divisors = self._divisors(passes)
        results = []
        for t, tower_pass in zip(working, passes):
            with tf.device(self.placement.devices[t]), tf.name_scope(f"tower_{t}"):
                results.append(self.tower.gradients(tower_pass, divisors))
        return results

    def _in_lockstep(self, working: list[int]) -> bool:
        """Whether the towers meet inside their passes: at every
        BatchNormalization layer (global batch statistics) or every coupled
        loss term computed from the whole batch (``towers/step/coupled.py``),
        with more than one tower with examples or a cluster."""
        statistics = self.moving_statistics
        meets = (
            statistics.statistics == "global" and bool(statistics.layers)
        ) or self.tower.coupled.exact
        return meets and (len(working) > 1 or self.workers is not None)

    def sum_losses(self, towers: list[TowerResult]) -> tf.Tensor:
        """The step's loss: the towers' shares, summed on the variable device."""
        with tf.device(self.device), tf.name_scope("combine"):
            return tf.add_n([r.loss for r in towers])

    def combine(self, tower_grads: list[list[Any]]) -> list[Any]:
        """``tower_grads[t][v]`` combined by the placement."""
        return self.placement.combine(tower_grads)

    def apply(self, grads: list, tower_variables: list, moments: list, weight: Any):
        """Counts the step and applies ``grads`` to the variables (tower t's:
        ``tower_variables[t]``), and the moving statistics; returns the
        finiteness flags or None."""
        with tf.name_scope("apply"):
            with tf.device(self.device):
                self.update.count_step()
            return self.placement.apply(
                self.update,
                grads,
                tower_variables,
                also=lambda: self.moving_statistics.update(moments),
                weight=weight,
            )

    # -- helpers ------------------------------------------------------------------

    def _each_tower(self, shards: Shards, work: Callable[..., Any]) -> list:
        results = []
        for t in self.placement.working_towers(shards):
            device = self.placement.devices[t]
            with tf.device(device), tf.name_scope(f"tower_{t}"):
                model = self.placement.model_of(t)
                x, y, sample_weight = shards.parts[t]
                results.append(work(model, x, y, sample_weight, shards.normaliser))
        return results

    def _divisors(self, passes: list) -> list[Any]:
        """The step's divisor per loss term (towers/step/losses.py)."""
        if not any(p.terms for p in passes) and all(p.extra is None for p in passes):
            raise ValueError(
                "the step has no loss: loss=None needs a model that adds its own "
                "(add_loss); received a model with no losses"
            )
        if self.workers is not None and self._normalisation(passes) == "global":
            raise ValueError(
                "in a cluster, a loss must be a mean over examples (Keras' default "
                "reductions, sample weights included) or a sum without model losses; "
                "received losses whose divisor comes from sample weights or a mask, "
                "or a mix of sums and means. Use one process."
            )
        with tf.device(self.device), tf.name_scope("divisors"):
            return step_divisors([p.terms for p in passes])

    def _normalisation(self, passes: list) -> str:
        return normalisation(passes[0].terms, passes[0].extra is not None)

    def _weight(self, towers: list, shards: Shards) -> Any:
        """What this step weighs when steps are added up (workers, micro-batches):
        its examples for a mean, nothing (None) for a sum."""
        mode = self._normalisation(towers)
        if mode == "global" and self.update.accumulate_steps > 1:
            sums = {t.kind for t in towers[0].terms} == {"sum"}
            why = (
                "a loss reduction='sum' and regularisation losses: the regulariser "
                "would count once per micro-batch"
                if sums
                else "losses whose divisor comes from sample weights or a mask, "
                "or a mix of sums and means"
            )
            raise ValueError(
                f"accumulate_steps > 1 cannot be exact with {why}; received them "
                "together. Use a mean reduction (Keras' default)."
            )
        if mode == "sum":
            return None
        return tf.cast(shards.size, tf.float32)

    def _update_metrics(self, y: Any, sample_weight: Any, towers: list, shares) -> None:
        with tf.device(self.device), tf.name_scope("metrics"):
            predictions = [r.predictions for r in towers]
            self.metrics.update(y, predictions, sample_weight, shares)

    def _output_losses(self, shares: list[dict], examples: Any) -> Any:
        """Each output's loss this step (the towers' shares summed), with the
        step's examples: what the per-output loss trackers take."""
        if not shares or not shares[0]:
            return None
        with tf.device(self.device), tf.name_scope("metrics"):
            values = {name: tf.add_n([s[name] for s in shares]) for name in shares[0]}
        return values, examples

    def _track(self, loss: tf.Tensor, examples: Any) -> dict[str, tf.Tensor]:
        """Adds the loss to its tracker; returns the metrics' values."""
        with tf.device(self.device), tf.name_scope("metrics"):
            self.metrics.track_loss(loss, examples)
            return self.metrics.results()

    def _metric_changes(self, y, sample_weight, towers, output_losses):
        predictions = [r.predictions for r in towers]
        return self.metrics.update_changes(y, predictions, sample_weight, output_losses)

    def _across_workers(self, grads, loss, weight, examples, update_metrics, kind):
        """This worker's gradients, loss and metric changes (``update_metrics``
        makes them) summed with every other worker's (the metrics then hold the
        cluster's); a ``Summed``."""
        with tf.device(self.device), tf.name_scope("across_workers"):
            changes = update_metrics()
            summed = self.workers.step(
                grads, loss, examples, changes.deltas, weight, kind
            )
            self.metrics.set_changes(changes, summed.extras)
        return summed


def _concat(parts: list[Any]) -> Any:
    return tf.nest.map_structure(lambda *p: tf.concat(p, axis=0), *parts)


def _is_tensor_or_none(part: Any) -> bool:
    return part is None or isinstance(part, tf.Tensor)

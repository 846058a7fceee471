"""The data path of one step, in the order a batch takes it::

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

from towers.cluster.workers import Summed, Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards, batch_size_of
from towers.step.batches import HOST
from towers.step.metrics import Metrics
from towers.step.prepare import Preparing
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.rules.grad_rules import combined
from towers.step.rules.state import (
    assign,
    exchanged,
    rule_of,
    settle_apart_metrics,
    state_variables,
)
from towers.step.rules.whole_batch import concat_rows
from towers.step.run.runner import Runner
from towers.step.work.builtin import Tower, TowerResult
from towers.step.work.losses import normalisation, step_divisors


class Step(Preparing):
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
        self.runner = Runner(placement, tower, moving_statistics, workers)
        self.device = placement.variable_device
        self.started = False  # start() ran: the model's parts are ready
        self._sized = False  # the first batch looked at for idle towers
        self.custom: Any = None  # the model's own steps (own.py), if any
        # What the towers' passes assign (state.py): variable path -> its rule.
        self.assigned: dict[str, str] = {}

    def owns(self, kind: str) -> bool:
        """Whether the towers' work in the ``kind`` step is the model's own
        step (``own.py``) in place of the built-in pass."""
        return self.custom is not None and kind in self.custom.kinds

    def train(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        """One training step. Returns ``{"logs": {"loss": the batch's loss,
        metric: value}}``, ``"reported"``: what Keras' ``train_step`` returns
        (the loss's running mean; a model's own step's logs), ``"finite"``
        (per applied gradient) when the update checks its gradients, in a
        cluster ``"stop"``: workers asking to stop."""
        shards = self.split(x, y, sample_weight)
        if self.owns("train"):  # the model's own step on every tower
            logs = self.custom.run("train_step", shards, (x, y, sample_weight))
            self.update.count_step()
            out = {"logs": logs, "reported": logs}
            checked = self.custom.applies.finite()
            if checked is not None:  # named by the engine under "raise"
                out["finite"], self.update.applied = checked
            if self.workers is not None:
                out["stop"] = self.custom.stop()
            return out
        before = self._before()
        towers = self.compute(shards)
        loss = self.sum_losses([r.loss for r in towers])
        grads = self.combine([r.grads for r in towers], (x, y, sample_weight))
        weight = self._weight(towers, shards)
        batch, outputs = (x, y, sample_weight), [r.output_losses for r in towers]
        settled, summed = self._after_towers(
            before, batch, shards, towers, loss, outputs, grads, weight, "train"
        )
        if self.workers is not None and weight is not None:
            weight = tf.cast(summed.examples, tf.float32)
        # Every tower (and every check in it) has finished before any update.
        with tf.control_dependencies([summed.loss]):
            variables = [r.variables for r in towers]
            moments = [r.moments for r in towers]
            # A trainable variable its forward pass assigned (a masked or
            # normalised kernel) takes the gradient after, as on one device.
            assign(settled, summed.state, trainable=True)
            rest = lambda: assign(settled, summed.state, trainable=False)  # noqa: E731
            finite = self.apply(summed.grads, variables, moments, weight, rest)
        reported = self._track(summed)
        out = {"logs": {**reported, "loss": summed.loss}, "reported": reported}
        if finite is not None:
            out["finite"] = finite
        if self.workers is not None:
            out["stop"] = summed.stop  # workers that asked to stop after this step
        return out

    def evaluate(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> dict[str, tf.Tensor]:
        """Updates the loss and metrics with one batch; returns their results
        (a model's own ``test_step``: its logs)."""
        shards = self.split(x, y, sample_weight)
        if self.owns("evaluate"):
            return self.custom.run("test_step", shards, (x, y, sample_weight))
        before = self._before()
        passes = self.runner.each(shards, self.tower.evaluate, "evaluate")
        divisors = step_divisors([p.terms for p in passes])
        loss = self.sum_losses([p.loss(divisors) for p in passes])
        outputs = [p.output_losses(divisors) for p in passes]
        weight = None if self.workers is None else self._weight(passes, shards)
        batch = (x, y, sample_weight)
        settled, summed = self._after_towers(
            before, batch, shards, passes, loss, outputs, [], weight, "eval"
        )
        assign(settled, summed.state)
        return self._track(summed)

    def predict(self, x: Any) -> Any:
        """The model's outputs on ``x``: the towers' shards', in tower order."""
        shards = self.split(x, None, None)
        if self.owns("predict"):
            return self.custom.run("predict_step", shards, (x,))
        passes = self.runner.each(shards, self.tower.predict, "predict")
        assign(self._settle_state(passes, shards, predict=True))
        with tf.device(HOST):
            return concat_rows([p.predictions for p in passes])

    def updates(self) -> list[Update]:
        """Every update the step applies by: the engine's, and a model's own
        step's (one per optimizer it applied with)."""
        own = [] if self.custom is None else self.custom.applies.updates.values()
        return [self.update, *own]

    @property
    def accumulate_steps(self) -> int:
        """The steps an update accumulates before it applies."""
        if self.owns("train"):
            return self.custom.applies.accumulate_steps
        return self.update.accumulate_steps

    @property
    def meetings(self) -> list[str]:
        """The optimizers a model's own train step met at, in order."""
        return [] if self.custom is None else self.custom.applies.names

    def flush(self) -> None:
        """Applies every partly filled ``accumulate_steps`` window, a model's
        own step's optimizers' too."""
        for update in self.updates():
            update.flush()

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the updates (``Update.state``), a model's
        own step's accumulators too, and the model's seed generators' states
        (which its layers do not hand a checkpoint): a resumed run draws on
        where the uninterrupted one would."""
        state = self.update.state()
        if self.custom is not None and self.custom.applies.accumulate_steps > 1:
            state["own_step_updates"] = self.custom.applies.saved
        seeds = state_variables(self.placement.model)
        if seeds:
            state["seed_states"] = {str(i): v for i, v in enumerate(seeds)}
        return state

    # -- the phases ---------------------------------------------------------------

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """The batch cut into the towers' shards ``(x_t, y_t, sw_t)``, on the host."""
        return self.runner.split(x, y, sample_weight)

    def compute(self, shards: Shards) -> list[TowerResult]:
        """Every working tower's forward pass, the step's divisors, then every
        tower's loss share and gradients, each on its tower's device, run the
        way the runner decides (``towers/step/run/runner.py``)."""
        return self.runner.train(
            shards, self._divisors, lambda passes: self._weight(passes, shards)
        )

    def sum_losses(self, losses: list[tf.Tensor]) -> tf.Tensor:
        """The step's loss: the towers' shares, summed on the variable device."""
        with tf.device(self.device), tf.name_scope("combine"):
            return tf.add_n(losses)

    def combine(self, tower_grads: list[list[Any]], batch: Any = None) -> list[Any]:
        """``tower_grads[t][v]`` combined by the placement, as one device's
        where adding them up is not (``grad_rules.combined``)."""
        return combined(self.placement, tower_grads, batch)

    def apply(
        self,
        grads: list,
        tower_variables: list,
        moments: list,
        weight: Any,
        also: Callable[[], None] = lambda: None,
    ):
        """Counts the step and applies ``grads`` to the variables (tower t's:
        ``tower_variables[t]``), the moving statistics and ``also`` (the
        state the towers assigned) with them; returns the finiteness flags or
        None."""

        def updates() -> None:
            self.moving_statistics.update(moments)
            also()

        with tf.name_scope("apply"):
            with tf.device(self.device):
                self.update.count_step()
            return self.placement.apply(
                self.update, grads, tower_variables, also=updates, weight=weight
            )

    # -- helpers ------------------------------------------------------------------

    def _divisors(self, passes: list) -> list[Any]:
        """The step's divisor per loss term (towers/step/work/losses.py)."""
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

    def _update_metrics(self, x, y, sample_weight, towers: list) -> None:
        with tf.device(self.device), tf.name_scope("metrics"):
            predictions = [r.predictions for r in towers]
            self.metrics.update(x, y, predictions, sample_weight)

    def _output_losses(self, shares: list[dict]) -> dict[str, tf.Tensor]:
        """Each output's loss this step (the towers' shares summed), for a
        model with several: what the per-output loss trackers take."""
        if not shares or not shares[0]:
            return {}
        with tf.device(self.device), tf.name_scope("metrics"):
            return {name: tf.add_n([s[name] for s in shares]) for name in shares[0]}

    def _track(self, summed: Summed) -> dict[str, tf.Tensor]:
        """Adds the step's loss and each output's to their trackers; returns
        every metric's value, the loss tracker's included."""
        with tf.device(self.device), tf.name_scope("metrics"):
            outputs = None if self.tower.own_loss else summed.outputs
            self.metrics.track(summed.loss, summed.examples, outputs)
            return self.metrics.results()

    def _before(self) -> Any:
        """In a cluster, the metrics as they are before any tower updates one."""
        return None if self.workers is None else self.metrics.snapshot()

    def _after_towers(
        self, before, batch, shards, passes, loss, outputs, grads, weight, kind
    ) -> tuple[list, Summed]:
        """What the built-in train and evaluation steps do after their
        towers: the state the towers assigned settled, each output's loss
        summed (``outputs``), the metrics updated;
        in a cluster all of it and ``grads`` every worker's, in one packed
        sum (metrics changed since ``before``). Returns the settled state and
        the step's sums (``Summed.outputs``: each output's loss)."""
        settled = self._settle_state(passes, shards)
        named = self._output_losses(outputs)
        self._update_metrics(*batch, passes)
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

    def _settle_state(self, passes: list, shards: Shards, predict=False) -> list:
        """The towers' assigned state, settled (``towers/step/rules/state.py``); each
        variable's rule kept in ``assigned`` (``towers explain`` lists them)."""
        for tower_pass in passes[:1]:
            self.assigned.update({v.path: rule_of(v) for v in tower_pass.state})
        cluster = None if self.workers is None else self.workers.cluster
        working = shards.working() if predict else self.placement.working_towers(shards)
        sizes = [batch_size_of(shards.parts[t]) for t in working]
        models = self.placement.models
        return settle_apart_metrics(passes, sizes, models, cluster)

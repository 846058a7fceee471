"""One step, in the order a batch takes it: split, the work, the tail::

    (x, y): B examples on the host
      -> split      Shards: tower t gets n_t examples, sum_t n_t = B
      -> the work   each tower on devices[t]: the built-in pass (loss_t =
                    sum(per-example) / B, grads_t) or the model's own step
      -> the tail   combine, the workers' sum, apply once, state, metrics

The engine traces :meth:`Step.train` and :meth:`Step.evaluate` into one
``tf.function`` each; ``towers bench`` times the phases alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.cluster.workers import Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards
from towers.step.batches import HOST
from towers.step.metrics import Metrics
from towers.step.prepare import Preparing
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.rules.state import assign, state_variables
from towers.step.rules.whole_batch import concat_rows
from towers.step.run.runner import Runner
from towers.step.tail import Tail
from towers.step.work.builtin import BuiltIn, TowerResult
from towers.step.work.losses import step_divisors, step_kind


class Step(Preparing):
    """One engine's train, evaluation and predict steps.

    Args:
      placement: where the variables live; combines and applies.
      builtin: the built-in pass.
      update: the apply's policies, the steps counter.
      metrics: the loss tracker and metrics.
      moving_statistics: BatchNormalization's once-per-step update.
      workers: the other workers of a cluster, or None."""

    def __init__(
        self,
        placement: Placement,
        builtin: BuiltIn,
        update: Update,
        metrics: Metrics,
        moving_statistics: MovingStatistics,
        workers: Workers | None,
    ):
        self.placement = placement
        self.builtin = builtin
        self.update = update
        self.metrics = metrics
        self.moving_statistics = moving_statistics
        self.workers = workers
        self.runner = Runner(placement, builtin, moving_statistics, workers)
        self.tail = Tail(placement, metrics, moving_statistics, workers)
        self.device = placement.variable_device
        self.started = False  # start() ran: the model's parts are ready
        self._sized = False  # the first batch looked at for idle towers
        # Each kind's work, the built-in pass's unless the model's own
        # (work/own.py) takes its place: nothing below asks which it is.
        self.works: dict[str, Callable[[Shards, tuple], Any]] = {
            "train": self._train, "evaluate": self._evaluate,
            "predict": self._predict,
        }  # fmt: skip
        self._own: Any = None

    @property
    def own(self) -> Any:
        """The model's own steps (``work/own.py``), or None."""
        return self._own

    @own.setter
    def own(self, own: Any) -> None:
        self._own = own
        self.works.update({kind: getattr(own, kind) for kind in own.kinds})

    @property
    def assigned(self) -> dict[str, str]:
        """What the towers' passes assign: variable path -> its rule."""
        return self.tail.assigned

    def owns(self, kind: str) -> bool:
        """Whether the ``kind`` step's work is the model's own step."""
        return self.own is not None and kind in self.own.kinds

    def train(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        """One training step: ``{"logs": ..., "reported": what Keras' train_step
        returns}``, with ``"finite"`` where the update checks its gradients and,
        in a cluster, ``"stop"``: the workers asking to stop."""
        batch = (x, y, sample_weight)
        return self.works["train"](self.split(*batch), batch)

    def _train(self, shards: Shards, batch: tuple) -> dict[str, Any]:
        tail, before = self.tail, self.tail.before()
        towers = self.compute(shards)
        loss = self.sum_losses([r.loss for r in towers])
        grads = self.combine([r.grads for r in towers], batch)
        weight = self._weight(towers, shards)
        outputs = [r.output_losses for r in towers]
        settled, summed = tail.across(
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
        reported = tail.track(summed, self.builtin.own_loss)
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
        batch = (x, y, sample_weight)
        return self.works["evaluate"](self.split(*batch), batch)

    def _evaluate(self, shards: Shards, batch: tuple) -> dict[str, tf.Tensor]:
        before = self.tail.before()
        passes = self.runner.each(shards, self.builtin.evaluate, "evaluate")
        divisors = step_divisors([p.terms for p in passes])
        loss = self.sum_losses([p.loss(divisors) for p in passes])
        outputs = [p.output_losses(divisors) for p in passes]
        weight = None if self.workers is None else self._weight(passes, shards)
        settled, summed = self.tail.across(
            before, batch, shards, passes, loss, outputs, [], weight, "eval"
        )
        assign(settled, summed.state)
        return self.tail.track(summed, self.builtin.own_loss)

    def predict(self, x: Any) -> Any:
        """The model's outputs on ``x``: the towers' shards', in tower order."""
        return self.works["predict"](self.split(x, None, None), (x,))

    def _predict(self, shards: Shards, batch: tuple) -> Any:
        passes = self.runner.each(shards, self.builtin.predict, "predict")
        assign(self.tail.settle(passes, shards, predict=True))
        with tf.device(HOST):
            return concat_rows([p.predictions for p in passes])

    def updates(self) -> list[Update]:
        """Every update the step applies by: the engine's, and a model's own
        step's (one per optimizer it applied with)."""
        own = [] if self.own is None else self.own.applies.updates.values()
        return [self.update, *own]

    @property
    def accumulate_steps(self) -> int:
        """The steps an update accumulates before it applies."""
        if self.owns("train"):
            return self.own.applies.accumulate_steps
        return self.update.accumulate_steps

    @property
    def meetings(self) -> list[str]:
        """The optimizers a model's own train step met at, in order."""
        return [] if self.own is None else self.own.applies.names

    def flush(self) -> None:
        """Applies every partly filled ``accumulate_steps`` window, a model's
        own step's optimizers' too."""
        for update in self.updates():
            update.flush()

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves: the updates' state (an own step's accumulators
        too) and the seed generators' states, which no layer hands a checkpoint."""
        state = self.update.state()
        if self.own is not None and self.own.applies.accumulate_steps > 1:
            state["own_step_updates"] = self.own.applies.saved
        seeds = state_variables(self.placement.model)
        if seeds:
            state["seed_states"] = {str(i): v for i, v in enumerate(seeds)}
        return state

    # -- the phases ---------------------------------------------------------------

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """The batch cut into the towers' shards ``(x_t, y_t, sw_t)``, on the host."""
        return self.runner.split(x, y, sample_weight)

    def compute(self, shards: Shards) -> list[TowerResult]:
        """Every working tower's loss share and gradients, as the runner runs them."""
        return self.runner.train(
            shards, self._divisors, lambda passes: self._weight(passes, shards)
        )

    def sum_losses(self, losses: list[tf.Tensor]) -> tf.Tensor:
        """The step's loss: the towers' shares, summed on the variable device."""
        return self.tail.sum_losses(losses)

    def combine(self, tower_grads: list[list[Any]], batch: Any = None) -> list[Any]:
        """``tower_grads[t][v]`` combined by the placement (``Tail.combine``)."""
        return self.tail.combine(tower_grads, batch)

    def apply(
        self,
        grads: list,
        tower_variables: list,
        moments: list,
        weight: Any,
        also: Callable[[], None] = lambda: None,
    ):
        """Counts the step and applies ``grads`` (tower t's variables:
        ``tower_variables[t]``), the moving statistics and ``also`` with them;
        the finiteness flags or None."""

        def updates() -> None:
            self.moving_statistics.update(moments)
            also()

        with tf.name_scope("apply"):
            with tf.device(self.device):
                self.update.count_step()
            return self.tail.apply(self.update, grads, tower_variables, weight, updates)

    # -- helpers ------------------------------------------------------------------

    def _divisors(self, passes: list) -> list[Any]:
        """The step's divisor per loss term (towers/step/work/losses.py)."""
        if not any(p.terms for p in passes) and all(p.extra is None for p in passes):
            raise ValueError(
                "the step has no loss: loss=None needs a model that adds its own "
                "(add_loss); received a model with no losses"
            )
        if self.workers is not None and self._kind(passes) == "global":
            raise ValueError(
                "in a cluster, a loss must be a mean over examples (Keras' default "
                "reductions, sample weights included) or a sum without model losses; "
                "received losses whose divisor comes from sample weights or a mask, "
                "or a mix of sums and means. Use one process."
            )
        with tf.device(self.device), tf.name_scope("divisors"):
            return step_divisors([p.terms for p in passes])

    def _kind(self, passes: list) -> str:
        return step_kind(passes[0].terms, passes[0].extra is not None)

    def _weight(self, towers: list, shards: Shards) -> Any:
        """What this step weighs when steps are added up (workers, micro-batches):
        its examples for a mean, nothing (None) for a sum."""
        mode = self._kind(towers)
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

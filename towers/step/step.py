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

from towers._keras import built_symbolically, trainable_capable
from towers.cluster.workers import Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards, batch_size_of
from towers.step.batches import HOST, check_sizes, check_targets, first_example, on_host
from towers.step.batchnorm import MovingStatistics
from towers.step.custom import overrides, own
from towers.step.gathered import concat_rows
from towers.step.grad_rules import as_one_devices
from towers.step.losses import normalisation, step_divisors
from towers.step.metrics import Metrics
from towers.step.runner import Runner
from towers.step.state import assign, exchanged, rule_of, settle_apart_metrics
from towers.step.tower import Tower, TowerResult


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
        self.runner = Runner(placement, tower, moving_statistics, workers)
        self.device = placement.variable_device
        self.started = False  # start() ran: the model's parts are ready
        self.custom: Any = None  # the model's own steps (custom.py), if any
        self._warned: set[str] = set()  # state variables warned of (state.py)
        # What the towers' passes assign (state.py): variable path -> its rule.
        self.assigned: dict[str, str] = {}

    def train(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        """One training step. Returns ``{"logs": {"loss": the batch's loss,
        metric: value}}``, ``"finite"`` (per applied gradient) when the update
        checks its gradients, in a cluster ``"stop"``: workers asking to stop."""
        # In a cluster, the metrics as they were before any tower updated one.
        before = None if self.workers is None else self.metrics.snapshot()
        shards = self.split(x, y, sample_weight)
        towers = self.compute(shards)
        settled = self._settle_state(towers, shards)
        loss = self.sum_losses(towers)
        grads = self.combine([r.grads for r in towers], (x, y, sample_weight))
        examples, weight = shards.size, self._weight(towers, shards)
        outputs = self._output_losses([r.output_losses for r in towers])
        self._update_metrics(x, y, sample_weight, towers)
        changes = None
        if self.workers is not None:
            summed = self._across_workers(
                before, grads, loss, weight, examples, outputs, settled, "train"
            )
            grads, loss, examples = summed.grads, summed.loss, summed.examples
            outputs = dict(zip(outputs, summed.means))
            weight = None if weight is None else tf.cast(examples, tf.float32)
            changes = summed.state
        # Every tower (and every check in it) has finished before any update.
        with tf.control_dependencies([loss]):
            variables = [r.variables for r in towers]
            moments = [r.moments for r in towers]
            # A trainable variable its forward pass assigned (a masked or
            # normalised kernel) takes the gradient after, as on one device.
            assign(settled, changes, trainable=True)
            rest = lambda: assign(settled, changes, trainable=False)  # noqa: E731
            finite = self.apply(grads, variables, moments, weight, rest)
        logs = {**self._track(loss, outputs, examples), "loss": loss}
        out = {"logs": logs} if finite is None else {"logs": logs, "finite": finite}
        if self.workers is not None:
            out["stop"] = summed.stop  # workers that asked to stop after this step
        return out

    def evaluate(
        self, x: Any, y: Any, sample_weight: Any = None
    ) -> dict[str, tf.Tensor]:
        """Updates the loss and metrics with one batch; returns their results."""
        before = None if self.workers is None else self.metrics.snapshot()
        shards = self.split(x, y, sample_weight)
        passes = self.runner.each(shards, self.tower.evaluate, "evaluate")
        settled = self._settle_state(passes, shards)
        divisors = step_divisors([p.terms for p in passes])
        towers = [p.loss(divisors) for p in passes]
        with tf.device(self.device), tf.name_scope("combine"):
            loss = tf.add_n(towers)
        examples = shards.size
        outputs = self._output_losses([p.output_losses(divisors) for p in passes])
        self._update_metrics(x, y, sample_weight, passes)
        changes = None
        if self.workers is not None:
            weight = self._weight(passes, shards)
            summed = self._across_workers(
                before, [], loss, weight, examples, outputs, settled, "eval"
            )
            loss, examples = summed.loss, summed.examples
            outputs = dict(zip(outputs, summed.means))
            changes = summed.state
        assign(settled, changes)
        return self._track(loss, outputs, examples)

    def predict(self, x: Any) -> Any:
        """The model's outputs on ``x``: the towers' shards', in tower order."""
        shards = self.split(x, None, None)
        passes = self.runner.each(shards, self.tower.predict, "predict")
        assign(self._settle_state(passes, shards, predict=True))
        with tf.device(HOST):
            return concat_rows([p.predictions for p in passes])

    def start(self) -> None:
        """Makes the parts ready once the model has its variables: the
        optimizers' slots, the update's counters, the placement's device checks,
        and in a cluster the chief's values on every worker."""
        # Keras callbacks (LearningRateScheduler...) find it there, as on compile.
        self.placement.model.optimizer = self.placement.optimizer
        self.started = True
        if own(self, "train") is None or len(self.placement.models) > 1:
            # An own train_step's optimizers build at their first apply (Keras').
            self.placement.build_slots()
        self.update.build(trainable_capable(self.placement.model))
        self.placement.check_devices()
        if self.workers is not None:
            self.workers.start_together(self.placement.model.variables)

    def flush(self) -> None:
        """Applies every partly filled ``accumulate_steps`` window, a model's
        own step's optimizers' too."""
        self.update.flush()
        if self.custom is not None:
            self.custom.applies.flush()

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the updates (``Update.state``), a model's
        own step's accumulators too."""
        state = self.update.state()
        if self.custom is not None and self.custom.applies.accumulate_steps > 1:
            state["own_step_updates"] = self.custom.applies.saved
        return state

    def probe(
        self, x: Any, y: Any, sample_weight: Any = None, training: bool = True
    ) -> None:
        """Before the first training step (or evaluation, ``training`` False):
        the model's loss terms that are not a mean over the examples gathered,
        refused by name or warned of (``towers/step/coupled.py``); a no-op
        after."""
        coupled, jit, model = self.tower.coupled, self.tower.jit, self.placement.model
        batch, own = (x, y, sample_weight), self.tower.own_loss
        coupled.probe(model, batch, own, self.device, jit.strict, training)
        if self.custom is not None:
            self.custom.probe(batch, training)

    def build_metrics(self, x, y=None, sample_weight=None, training=True) -> None:
        """Before a first training (or evaluation) step: its targets checked
        against the loss where towers' own step computes it (a model's own
        step reads its data itself), the compiled metrics built from its
        shapes (tensors or ``tf.TensorSpec``), as Keras' fit does."""
        if own(self, "train" if training else "evaluate") is None:
            check_targets(self.tower.loss, y)
        elif y is None:  # built by the step as it calls them, as in Keras' fit
            return
        self.metrics.build(x, y, sample_weight)

    def whole_batch_loss(self, x: Any, y: Any, sample_weight: Any = None) -> bool:
        """After a loss gave one value for the batch while the step was traced
        (``losses.OneValue``, nothing updated): the step takes Keras'
        ``compute_loss`` of the whole batch instead, with the compiled loss,
        gathered (its per-output trackers see the batch's; the probe runs
        again on this batch). False if it did already: the error stands."""
        if self.tower.own_loss:
            return False
        self.tower.own_loss = True
        self.tower.coupled.probe_again()
        self.tower.coupled.gather_compute_loss()
        self.probe(x, y, sample_weight)
        return True

    def prepare(
        self, x: Any, y: Any = None, sample_weight: Any = None, kind: str = ""
    ) -> tuple:
        """Checks a batch, puts it on the host as tensors (``batches.py``), and
        builds a model that is not built from it (then :meth:`start`).

        Raises:
          ValueError: x, y and sample_weight disagree on B where towers' own
            ``kind`` step reads them (a model's own reads its data itself), or
            B == 0 outside a cluster (a worker's share may be empty).
        """
        apart = own(self, kind) is not None
        check_sizes(x, y, sample_weight, self.workers is not None, apart)
        x, y, sample_weight = on_host((x, y, sample_weight))
        model = self.placement.model
        unbuilt = not model.built or not (model.variables or built_symbolically(model))
        if apart:  # by the model's own step as it first runs, as in Keras' fit
            self.custom.build((x, y, sample_weight), kind)
        elif unbuilt and overrides(model, "call"):
            # Built from the first batch, as Keras' fit builds it, whatever
            # variables it made already; one with no call() is never called.
            self.placement.build_from(first_example(x))
        if not self.started:
            self.start()
        return x, y, sample_weight

    # -- the phases ---------------------------------------------------------------

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """The batch cut into the towers' shards ``(x_t, y_t, sw_t)``, on the host."""
        return self.runner.split(x, y, sample_weight)

    def compute(self, shards: Shards) -> list[TowerResult]:
        """Every working tower's forward pass, the step's divisors, then every
        tower's loss share and gradients, each on its tower's device, run the
        way the runner decides (``towers/step/runner.py``)."""
        return self.runner.train(
            shards, self._divisors, lambda passes: self._weight(passes, shards)
        )

    def sum_losses(self, towers: list[TowerResult]) -> tf.Tensor:
        """The step's loss: the towers' shares, summed on the variable device."""
        with tf.device(self.device), tf.name_scope("combine"):
            return tf.add_n([r.loss for r in towers])

    def combine(self, tower_grads: list[list[Any]], batch: Any = None) -> list[Any]:
        """``tower_grads[t][v]`` combined by the placement (none to combine
        for a model without trainable variables); a shared model's slices of
        rows apart from ``batch`` and its values in place of gradients as one
        device's (``grad_rules.py``)."""
        copies = len(self.placement.models) > 1
        if not tower_grads[0]:
            return [[] for _ in tower_grads] if copies else []
        if batch is not None and not copies:
            with tf.device(self.device), tf.name_scope("combine"):
                variables = self.placement.model.trainable_variables
                tower_grads = as_one_devices(tower_grads, variables, batch)
        return self.placement.combine(tower_grads)

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

    def results(self) -> dict[str, tf.Tensor]:
        """Every metric's running value, as ``model.get_metrics_result()``."""
        with tf.device(self.device), tf.name_scope("metrics"):
            return self.metrics.results()

    def _track(self, loss, outputs, examples) -> dict[str, tf.Tensor]:
        """Adds the loss and each output's to their trackers; returns every
        metric's value, the loss tracker's included."""
        with tf.device(self.device), tf.name_scope("metrics"):
            self.metrics.track(loss, examples, None if self.tower.own_loss else outputs)
            return self.metrics.results()

    def _across_workers(
        self, before, grads, loss, weight, examples, outputs, settled, kind
    ):
        """This worker's gradients, loss, output losses, metric changes since
        ``before`` and the towers' assigned state (``settled``) summed with
        every other worker's (the metrics then hold the cluster's); a
        ``Summed`` with ``state``: the state's summed changes."""
        with tf.device(self.device), tf.name_scope("across_workers"):
            deltas, sent = before.deltas(), exchanged(settled)
            summed = self.workers.step(
                grads,
                loss,
                examples,
                [*deltas, *sent],
                weight,
                kind,
                means=list(outputs.values()),
            )
            cut = len(deltas)
            before.set(summed.extras[:cut])
            summed.state = summed.extras[cut:]
        return summed

    def _settle_state(self, passes: list, shards: Shards, predict=False) -> list:
        """The towers' assigned state, settled (``towers/step/state.py``); each
        variable's rule kept in ``assigned`` (``towers explain`` lists them)."""
        for tower_pass in passes[:1]:
            self.assigned.update({v.path: rule_of(v) for v in tower_pass.state})
        cluster = None if self.workers is None else self.workers.cluster
        working = shards.working() if predict else self.placement.working_towers(shards)
        sizes = [batch_size_of(shards.parts[t]) for t in working]
        models = self.placement.models
        return settle_apart_metrics(passes, sizes, models, cluster, self._warned)

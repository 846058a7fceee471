"""A model's own ``train_step``, ``test_step`` and ``predict_step`` (those it
overrides), run by every tower on its shard.

Each tower runs the model's step (traced once per shard shape and cut where
the towers meet, or in turns) and meets the others at each
``optimizer.apply`` (``applies.py``), assignment and metric update
(``rules/assignments.py``) and BatchNormalization call in training mode, so
what the step changes changes once, as on one device. Each gradient is a
mean's over the tower's rows, however its loss reads the batch
(``loss_kinds.py``), weighted by the tower's share ``n_t / B``."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import keras
import tensorflow as tf

from towers._keras import layers_of
from towers._keras.patches import routed_applies, routed_gradients
from towers.cluster.workers import Workers
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards
from towers.step.batches import HOST
from towers.step.rules import draws, loss_kinds, probe
from towers.step.rules.assignments import Assignments
from towers.step.rules.whole_batch import concat_rows, whole_batch_loss
from towers.step.run.runner import Runner
from towers.step.run.seats import current
from towers.step.work.applies import Applies
from towers.step.work.copies import gather_metrics, level_metrics
from towers.step.work.hooks import own_hook
from towers.step.work.logs import Logs, is_float, share


class OwnStep:
    """A model's own steps as the towers' work in :class:`Step`, meeting at each
    apply (``placement``: one model the towers share; ``update``: the
    engine's policies, per apply; ``kinds``: the steps that are the model's)."""

    def __init__(
        self,
        placement: Placement,
        runner: Runner,
        update: Update,
        kinds: frozenset[str],
        metrics: Any,
        workers: Workers | None = None,
        moving: Any = None,
        accumulate_steps: int = 1,
        tail: Any = None,
    ):
        self.placement = placement
        self.runner = runner
        self.kinds = kinds
        self.metrics = metrics  # the engine's (towers/step/metrics.py)
        self.workers = workers  # a cluster's (towers/cluster/workers.py), or None
        self.moving = moving  # BatchNormalization's (towers/step/rules/batchnorm.py)
        self.applies = Applies(placement, update, accumulate_steps, tail)
        # In a cluster, while a step is traced: the runner's handle on the
        # workers, its weight this worker's B_w / B (0 without examples).
        self._across: Any = None
        self._stop: Any = None  # the workers asking to stop, after a train step
        self._batch: list[Any] = []  # the step's input tensors, while traced
        self._logs_found: dict[str, dict] = {}  # by hook: each number's kind
        self._built: set[str] = set()  # the kinds whose first trace built

    @property
    def model(self) -> keras.Model:
        return self.placement.model

    def probe(self, batch: tuple, training: bool = True) -> None:
        """Before the first step of two or more examples: how each loss the step
        takes the gradient of, and each number it returns, reads the batch
        (``probe.py``); not where one tower has the whole batch."""
        hook = "train_step" if training else "test_step"
        kind = "train" if training else "evaluate"
        if kind not in self.kinds or hook in self._logs_found:
            return
        self.applies.whole_batch = self.runner.builtin.coupled.gathered
        alone = len(self.placement.devices) == 1 and self.workers is None
        if self.applies.whole_batch or alone:
            return
        towers = len(self.placement.devices)
        found = probe.probe(self.model, batch, hook, towers, self.runner.learned)
        if found.unprobed:  # read as means; the first-step check decides
            self._logs_found[hook] = {}
            self.applies.unprobed |= training
        if found.losses is not None:
            self._logs_found[hook] = found.logs
            if training:
                self.applies.kinds = found.losses

    def build(self, batch: tuple, kind: str) -> None:
        """Creates the variables the model's ``kind`` step makes as it first runs
        (as Keras' fit's first trace): traced once on ``batch``, never run."""
        models = self.placement.models
        if kind in self._built or all(x.built for m in models for x in layers_of(m)):
            return
        self._built.add(kind)
        hook = "train_step" if kind == "train" else "test_step"
        devices = self.placement.devices if len(models) > 1 else [
            self.placement.variable_device]  # fmt: skip
        for model, device in zip(models, devices):
            step = own_hook(model, hook)
            with tf.device(device), routed_applies(loss_kinds.nothing):
                traced = tf.function(step, autograph=False)
                traced.get_concrete_function(keras.utils.pack_x_y_sample_weight(*batch))

    def train(self, shards: Shards, batch: tuple) -> dict[str, Any]:
        """The step's ``train`` (``Step.train``'s return) by the model's own
        ``train_step``: its logs, the finiteness of what it applied."""
        logs = self.run("train_step", shards, batch)
        self.applies.engine_update.count_step()
        out = {"logs": logs, "reported": logs}
        checked = self.applies.finite()
        if checked is not None:  # named by the engine under "raise"
            out["finite"], self.applies.engine_update.applied = checked
        if self.workers is not None:
            out["stop"] = self._stop
        return out

    def evaluate(self, shards: Shards, batch: tuple) -> Any:
        return self.run("test_step", shards, batch)

    def predict(self, shards: Shards, batch: tuple) -> Any:
        return self.run("predict_step", shards, batch)

    def run(self, hook: str, shards: Shards, batch: tuple) -> Any:
        """``model.<hook>`` as every working tower's work on its shard of
        ``batch``: the step's logs (``logs.py``), or ``predict_step``'s outputs
        concatenated in example order."""
        if hook == "predict_step":
            self._across = self.runner.across("predict")
            outputs = self._run(hook, shards)
            with tf.device(HOST):
                return concat_rows(outputs)
        kind = "train" if hook == "train_step" else "eval"
        self._across = self.runner.across(kind)
        copies = len(self.placement.models) > 1  # copies.py
        levelled = level_metrics(self.placement.models) if copies else None
        self._batch = tf.nest.flatten(batch, expand_composites=True)
        before, examples = None, tf.cast(shards.size, tf.float64)
        if self.workers is not None:
            with tf.device(self.placement.variable_device):
                before = self.metrics.snapshot(tracker=True)
                mine, examples = examples, self._across(examples, False)
                # This worker's weight in the workers' sums: B_w / B.
                self._across.weight = tf.math.divide_no_nan(mine, examples)
            self.applies.mine = mine
        self.applies.examples = tf.cast(examples, tf.float32)
        logs = self._run(hook, shards)
        if copies:
            gather_metrics(self.placement.models, levelled)
        kinds = self._logs_found.get(hook, {})
        reader = Logs(self.placement, self.applies, self.workers, self._across,
                      self._free, self._assignments)  # fmt: skip
        read = reader.read(logs, shards, kinds, before, kind == "train")
        self._stop = reader.stop
        return read

    def _run(self, hook: str, shards: Shards) -> list[Any]:
        # model.<hook>(data) on every working tower's shard; results in tower order.
        working = self.placement.working_towers(shards)
        self.applies.begin(self._across, self._batch)
        self._free: dict[Any, tf.Tensor] = {}  # a log's batch-free terms
        sums = "sum" in self._logs_found.get(hook, {}).values()

        def step(model: keras.Model, x, y, sample_weight, examples) -> Any:
            del examples  # the step's own loss divides by its shard's
            data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
            with self._moving_at_once(working):
                logs = own_hook(model, hook)(data)
            if hook == "predict_step":
                return logs
            # What the logs are as traced (the run's tensors are another
            # trace's, a cut's): metrics' results, losses taken as sums, and
            # where the probe found a sum, its batch-free terms.
            noted = []
            for leaf in tf.nest.flatten(logs):
                free = None
                if sums and is_float(leaf) and self.applies.as_mean(leaf) is leaf:
                    batch = current().inputs or self._batch
                    free = loss_kinds.batch_free(tf.convert_to_tensor(leaf), batch)
                result = assignments.is_result(leaf)
                noted.append((result, self.applies.as_mean(leaf), free))
            return logs, noted

        assignments = Assignments(
            self.placement.models,
            self._across,
            apart=self.placement.name == "independent",
        )
        assignments.as_mean = self.applies.as_mean
        assignments.loss_kind = self.applies.loss_kind
        self._assignments = assignments  # which logs are metrics' results
        weights = [share(shards, t) for t in working]
        models, learned = self.placement.models, self.runner.learned
        placed = draws.drawing(self.workers, models, shards.size, hook, learned)
        try:
            with (
                routed_applies(self.applies.meet),
                routed_gradients(self.applies.gradient),
                placed,
                assignments.routed(),
                self._whole_batch_loss(),
            ):
                seats = (weights, self._across)
                results = self.runner.each(shards, step, "own", seats)
            self.applies.refuse_raise(sorted(set(assignments.assigned)))
            if hook == "predict_step":
                return results
            for logs, noted in results:
                for leaf, (result, mean, free) in zip(tf.nest.flatten(logs), noted):
                    assignments.note(leaf, result)
                    if mean is not leaf:
                        self.applies.means[leaf.ref()] = mean
                    if free is not None:
                        self._free[leaf.ref()] = free
            return [logs for logs, _ in results]
        except threading.BrokenBarrierError as error:
            raise ValueError(
                f"the towers' {hook} did not make the same applies on every "
                f"shard ({error}); a step must, as the towers meet at each. "
                "Nothing was updated."
            ) from error
        except ValueError as error:
            named = probe.misfit(self.model, hook, error)
            if named is None:
                raise
            raise named from error

    def _whole_batch_loss(self) -> Any:
        # Where its compute_loss couples the examples: the whole batch's.
        if not self.runner.builtin.coupled.gathered:
            return contextlib.nullcontext()
        return whole_batch_loss(self.placement.models)

    def _moving_at_once(self, working: list[int]) -> Any:
        # Where BatchNormalization layers meet at each call in training mode.
        if self.moving is None or not self.moving.layers:
            return contextlib.nullcontext()
        if len(self.placement.models) > 1:
            return contextlib.nullcontext()  # independent copies: each its own
        if not self.runner.meets(working):
            return contextlib.nullcontext()  # the layers move them, as Keras'
        return self.moving.moving_at_once(self.placement.variable_device)

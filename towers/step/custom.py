"""A model's own ``train_step``, ``test_step`` and ``predict_step``, run by
every tower on its shard, the towers meeting at each apply. Only the steps a
model overrides run here (``kinds_of``); the others are towers' own.

Keras' documented way to customise training is to override ``train_step``
(a GAN's two optimizers, a VAE, a model with its own trackers). Each tower
calls the model's own step on its shard, under its device, run by the step's
runner (``towers/step/runner.py``) in turns (``towers/step/lockstep.py``, as
gathered losses meet), and every ``optimizer.apply`` or
``apply_gradients`` inside the step is a meeting::

    tower t:  forward, tape.gradient  ->  apply  ->  forward (new weights) -> ...
                                           ^ every tower's gradients, weighted by
                                             its share of the examples (n_t / B),
                                             summed; applied once, on the
                                             variable device

The first tower applies the towers' combined gradients with the optimizer's
own ``apply`` (``towers/step/applies.py``, with the engine's policies per
apply); every tower then goes on reading the updated variables (the
reads are traced after the apply, and TensorFlow runs a variable's reads and
assignments in the order they were traced). So a generator whose loss is
computed through the discriminator after the discriminator's update trains
to one device's weights. A step's scalar loss is a mean over its batch, as
Keras' losses are: each tower's gradient is weighted by ``n_t / B``; with
``Towers(own_step_loss="sum")``, a sum over it: the towers' gradients (and
returned values) are added up unweighted. A loss with a value per example
is a sum to the tape, and its gradients are added up so
(``towers/step/applies.py``).

What the step assigns and the metrics it updates meet too, and change once,
as on one device (``towers/step/assignments.py``). The logs are what the step
returns: a value that is
a metric's result is read after every tower has updated it; any other value
(a loss the step returns as it is) is the towers' values weighted by their
shares. In a cluster, the first tower sums the combined gradients of each
apply over the workers, each weighted by its share of the global batch
(``B_w / B``), before applying; the metrics are summed over the workers after
the step, and the other values weighted alike. A random draw in the step
(``keras.random`` with the model's ``SeedGenerator``, a Dropout layer) is
one device's: each tower draws its rows of the whole batch's numbers, and
the generator's state, assigned alike by every tower, moves once
(``towers/step/draws.py``). Each call of a BatchNormalization layer in training mode is
a meeting too: the first tower moves its moving statistics at once, from
every tower's moments (``MovingStatistics.moving_at_once``); under global
batch statistics each tower's upstream gradient through the moments is
weighted by its share (``meetings.Seat``), as its gradients are.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Literal

import keras
import tensorflow as tf

from towers._keras.patches import routed_applies, routed_gradients
from towers.combine import in_dtype
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.split import Shards, batch_size_of
from towers.step import draws, xla
from towers.step.applies import Applies
from towers.step.assignments import Assignments
from towers.step.batches import HOST
from towers.step.custom_copies import (
    gather_metrics,
    level_metrics,
    metric_variables,
)
from towers.step.gathered import concat_rows, whole_batch_loss
from towers.step.lockstep import across_workers
from towers.step.runner import Runner

# How a model's own train_step reduces its loss over its batch.
OwnStepLoss = Literal["mean", "sum"]

# The hooks a model overrides that make towers run Keras' steps.
HOOKS = ("train_step", "test_step", "predict_step", "compute_metrics")


def overrides(model: Any, name: str) -> bool:
    """Whether ``model``'s class overrides Keras' ``Model.<name>`` (a hook).

    >>> class Own(keras.Model):
    ...     def compute_loss(self, *args, **kwargs):
    ...         return super().compute_loss(*args, **kwargs)
    >>> overrides(Own(), "compute_loss"), overrides(keras.Sequential(), "compute_loss")
    (True, False)
    """
    return getattr(type(model), name, None) is not getattr(keras.Model, name)


def custom_hooks(model: keras.Model) -> list[str]:
    """The Keras step hooks ``model`` overrides (``HOOKS``)."""
    return [hook for hook in HOOKS if overrides(model, hook)]


def kinds_of(hooks: list[str]) -> frozenset[str]:
    """The steps (``"train"``, ``"evaluate"``, ``"predict"``) that run Keras'
    own for a model overriding ``hooks``; the others are towers' own, which
    are Keras' defaults (``compute_metrics`` is called by Keras' train and
    test steps)."""
    steps = {"train_step": "train", "test_step": "evaluate", "predict_step": "predict"}
    kinds = {steps[hook] for hook in hooks if hook in steps}
    if "compute_metrics" in hooks:
        kinds |= {"train", "evaluate"}
    return frozenset(kinds)


def own(step: Any, kind: str) -> CustomStep | None:
    """``step.custom`` when it runs the ``kind`` step, else None."""
    custom = step.custom
    return custom if custom is not None and kind in custom.kinds else None


class CustomStep:
    """The model's own steps on every tower, meeting at each apply.

    Args:
      placement: where the variables live (one model the towers share).
      runner: how the towers run (``towers/step/runner.py``): the step's.
      update: the engine's update: its steps counter, once per step, and
        its policies, per apply (``towers/step/applies.py``).
      kinds: the steps that are the model's own (``kinds_of``).
      loss: the step's loss is a ``"mean"`` over its batch or a ``"sum"``.
    """

    def __init__(
        self,
        placement: Placement,
        runner: Runner,
        update: Update,
        kinds: frozenset[str],
        loss: OwnStepLoss = "mean",
        workers: Any = None,
        moving: Any = None,
        accumulate_steps: int = 1,
    ):
        self.placement = placement
        self.runner = runner
        self.update = update
        self.kinds = kinds
        self.loss = loss
        self.workers = workers  # a cluster's (towers/cluster/workers.py), or None
        self.moving = moving  # BatchNormalization's (towers/step/batchnorm.py)
        self.applies = Applies(placement, update.on_nonfinite, accumulate_steps)
        # In a cluster, while a step is traced: the workers' sum, and this
        # worker's weight in it (B_w / B, 0 without examples).
        self._across: Any = None
        self._weight_here: Any = None

    @property
    def model(self) -> keras.Model:
        return self.placement.model

    def train(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        """One training step: the model's ``train_step`` on every tower.
        Returns ``{"logs": what the step returned, read as described}``."""
        logs = self._each_tower("train_step", x, y, sample_weight)
        self.update.count_step()
        out = {"logs": logs}
        checked = self.applies.finite()
        if checked is not None:  # named by the engine under "raise"
            out["finite"], self.update.applied = checked
        if self.workers is not None:
            out["stop"] = self._across(self.workers.stop_flag(), False)
        return out

    def evaluate(self, x: Any, y: Any, sample_weight: Any = None) -> dict:
        """The model's ``test_step`` on every tower; returns its logs."""
        return self._each_tower("test_step", x, y, sample_weight)

    def predict(self, x: Any) -> Any:
        """The model's ``predict_step`` on every tower, its outputs (any nest)
        concatenated in example order."""
        shards = self.runner.split(x, None, None)
        self._across, _ = across_workers(self.workers, "predict")
        outputs = self._run("predict_step", shards)
        with tf.device(HOST):
            return concat_rows(outputs)

    def _each_tower(self, hook: str, x: Any, y: Any, sample_weight: Any) -> dict:
        shards = self.runner.split(x, y, sample_weight)
        kind = "train" if hook == "train_step" else "eval"
        self._across, weight = across_workers(self.workers, kind)
        copies = len(self.placement.models) > 1  # custom_copies.py
        levelled = level_metrics(self.placement.models) if copies else None
        before = None
        if self.workers is not None:
            with tf.device(self.placement.variable_device):
                before = [tf.identity(v) for v in self._metric_variables()]
                self._weight_here = self._workers_weight(shards)
            # A backward sum over the workers (global batch statistics')
            # weighs each worker's upstream gradient as its gradients are.
            weight["examples"] = self._weight_here
        logs = self._run(hook, shards)
        if copies:
            gather_metrics(self.placement.models, levelled)
        if before is not None:  # every worker's changes, summed
            with tf.device(self.placement.variable_device):
                for v, b in zip(self._metric_variables(), before):
                    mine = tf.math.multiply_no_nan(
                        v - b, tf.cast(self._weight_here > 0, v.dtype)
                    )
                    v.assign(b + self._across(mine, False))
        return self._read_logs(logs, shards)

    def _metric_variables(self) -> list[Any]:
        return metric_variables(self.model)

    def _workers_weight(self, shards: Shards) -> Any:
        """This worker's weight in the workers' sums: B_w / B for a mean loss
        (0 for a worker without examples), 1 for a sum (0 without)."""
        mine = tf.cast(shards.size, tf.float64)
        if self.loss == "sum":
            return tf.cast(mine > 0, tf.float64)
        return tf.math.divide_no_nan(mine, self._across(mine, False))

    def _over_workers(self, value: tf.Tensor, summed: bool = False) -> tf.Tensor:
        """``value`` weighted by this worker's weight (1 for a gradient of a
        sum, ``summed``), summed over the workers (a worker without examples
        adds zeros, whatever its value)."""
        value = tf.convert_to_tensor(value)
        weight = tf.cast(self._weight_here, value.dtype)
        if summed:
            weight = tf.cast(weight > 0, value.dtype)
        return self._across(tf.math.multiply_no_nan(value, weight), False)

    def _run(self, hook: str, shards: Shards) -> list[Any]:
        """``model.<hook>(data)`` on every working tower's shard, run by the
        step's runner (in turns), meeting at each apply; their results in
        tower order."""
        working = self.placement.working_towers(shards)
        self.applies.begin(None if self.workers is None else self._over_workers)

        def step(model: keras.Model, x, y, sample_weight, examples) -> Any:
            del examples  # the step's own loss divides by its shard's
            data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
            with self._moving_at_once(len(working)):
                return getattr(model, hook)(data)

        assignments = Assignments(
            self.placement.models,
            self._across,
            apart=self.placement.name == "independent",
        )
        assignments.worker_weight = self._weight_here
        self._assignments = assignments  # which logs are metrics' results
        weights = [self._weight(shards, t) for t in working]
        try:
            with (
                routed_applies(self.applies.meet),
                routed_gradients(self.applies.gradient),
                draws.drawing(self.workers, self.placement.models, shards.size),
                assignments.routed(),
                self._whole_batch_loss(),
            ):
                seats = (weights, self.loss, self._across)
                results = self.runner.each(shards, step, "own", seats)
            self.applies.refuse_raise(sorted(set(assignments.assigned)))
            return results
        except threading.BrokenBarrierError as error:
            raise ValueError(
                f"the towers' {hook} did not make the same applies on every "
                f"shard ({error}); a step must, as the towers meet at each. "
                "Nothing was updated."
            ) from error

    def _whole_batch_loss(self) -> Any:
        """Where the model's ``compute_loss`` couples the batch's examples
        (the probe found it, ``towers/step/coupled.py``): within, the step's
        calls of it are the whole batch's (``gathered.whole_batch_loss``)."""
        if not self.runner.tower.coupled.gathered:
            return contextlib.nullcontext()
        return whole_batch_loss(self.placement.models)

    def _moving_at_once(self, working: int) -> Any:
        """Where BatchNormalization layers meet at each call in training mode
        (more than one tower, or a cluster): the first tower moves their
        moving statistics at once (``MovingStatistics.moving_at_once``)."""
        if self.moving is None or not self.moving.layers:
            return contextlib.nullcontext()
        if len(self.placement.models) > 1:
            return contextlib.nullcontext()  # independent copies: each its own
        if working == 1 and self.workers is None:
            return contextlib.nullcontext()  # the layers move them, as Keras'
        return self.moving.moving_at_once(self.placement.variable_device)

    def _weight(self, shards: Shards, t: int) -> Any:
        """Tower ``t``'s weight in the sums: its share, or 1 for a sum loss."""
        return _share(shards, t) if self.loss == "mean" else 1.0

    def _read_logs(self, logs: list[Any], shards: Shards) -> dict[str, Any]:
        """The step's logs: a metric's result (a value the step read from a
        metric's ``result()``, under its name; with a copy per tower, any
        value under a metric's name) read after every tower updated it; any
        other value weighted by the towers' shares. A dict of them (Keras'
        ``"compile_metrics"``) is read alike, entry by entry."""
        results = {}
        with tf.device(self.placement.variable_device):
            for metric in self.model.metrics:
                result = metric.result()
                if isinstance(result, dict):
                    results.update(result)
                else:
                    results[metric.name] = result
        if not isinstance(logs[-1], dict):
            return logs[-1]
        working = self.placement.working_towers(shards)

        def read(key: str, values: list[Any]) -> Any:  # each tower's, in order
            value = values[-1]
            if isinstance(value, dict):
                return {k: read(k, [v[k] for v in values]) for k in value}
            if key in results and self._assignments.is_result(value) is not False:
                return results[key]
            if not _is_float(value):
                return value
            parts = []
            for part, t in zip(values, working):
                part = tf.convert_to_tensor(part)
                parts.append(part * in_dtype(self._weight(shards, t), part.dtype))
            total = tf.add_n(parts)
            return total if self.workers is None else self._over_workers(total)

        return {key: read(key, [log[key] for log in logs]) for key in logs[-1]}


def refuse_with_hooks(
    hooks: list[str],
    placement: Placement,
    options: dict[str, Any],
    jit: Any,
) -> None:
    """Refuses, by name and before any step, what a model's own steps cannot
    run with yet; warns that an XLA step ``"auto"`` chose runs without XLA.

    Raises:
      ValueError: with the model's own train step, ``jit_compile=True``; with
        a copy per tower, micro-batches or a non-finite policy.
    """
    model = type(placement.model).__name__
    if "train" not in kinds_of(hooks):  # evaluation or prediction alone
        jit = xla.OFF  # nothing trains in them
        options = {"accumulate_steps": 1, "on_nonfinite": "ignore"}
    copies = f"placement={placement.name!r}" if len(placement.models) > 1 else ""
    refused = [
        (copies and options["accumulate_steps"] > 1, "accumulate_steps="
         f"{options['accumulate_steps']} with {copies}", "each copy's optimizer "
         "is built before the first step; use placement='central'"),
        (copies and options["on_nonfinite"] != "ignore", "on_nonfinite="
         f"{options['on_nonfinite']!r} with {copies}", "each copy applies its "
         "own; use placement='central'"),
        (jit.enabled and jit.strict, "jit_compile=True", "each tower's step "
         "stops at its applies; pass jit_compile=False"),
    ]  # fmt: skip
    for refuse, what, why in refused:
        if refuse:
            raise ValueError(
                f"a {model} that overrides {', '.join(hooks)} runs on every "
                f"tower, meeting at its applies; received {what}: {why}."
            )
    if jit.enabled:
        warnings.warn(
            f"a {model} that overrides {', '.join(hooks)} runs without XLA "
            "(jit_compile='auto' chose XLA): each tower's step stops at its "
            "applies.",
            stacklevel=2,
        )


def _share(shards: Shards, t: int) -> Any:
    """Tower ``t``'s share of the step's examples, ``n_t / B``."""
    if shards.sizes is not None and isinstance(shards.size, int):
        return shards.sizes[t] / shards.normaliser  # B, or 1 when empty
    n_t = tf.cast(batch_size_of(shards.parts[t]), tf.float64)
    return n_t / tf.cast(shards.normaliser, tf.float64)


def _is_float(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and tf.as_dtype(dtype).is_floating

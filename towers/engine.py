"""Towers: one model, shared variables on one device, one tower per compute device.

One training step is one ``tf.function``::

    (x, y): B examples on the host
      -> split_batch                      shards of n_t examples, sum_t n_t = B
      -> tower t on devices[t]            loss_t = sum(per-example loss) / B
                                          tower_grads[t] = d loss_t / d vars
      -> combine_gradients(sum)           on the variable device
      -> optimizer.apply_gradients once   on the variable device

Because each tower's loss is already divided by the *global* B, the sum of tower
gradients is the full-batch gradient: T towers give one device's update.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.batchnorm import MovingStatistics, MovingStatisticsPolicy
from towers.cluster import Cluster, resolve_cluster
from towers.collective import WorkerReduce, raise_if_lost
from towers.combine import combine_gradients, get_reducer
from towers.devices import canonical_device, resolve_devices, same_device
from towers.losses import TowerLoss
from towers.placement import (
    Placement,
    build_balanced,
    check_placement,
    updates_where_variables_live,
)
from towers.replicas import Replicas
from towers.split import batch_size_of, split_batch, split_sizes
from towers.update import NonfinitePolicy, Update, first_nonfinite

# Input arrives on the host and is split there, whatever the compute devices are.
_HOST = "/device:CPU:0"

# The step's output that carries, per applied gradient, whether it was finite.
_FINITE = "_finite"


class Towers:
    """Data-parallel training with one tower per device and shared variables.

    Args:
      model: a zero-arg function that builds a Keras model (it is called under
        ``variable_device``), or a Keras model whose variables already live there.
      loss: a ``keras.losses.Loss`` (any reduction), a Keras loss name, or a
        function ``(y_true, y_pred) -> per-example losses``.
      optimizer: a Keras optimizer, or a zero-arg function that makes one (called
        under ``variable_device``). Its slots are always created on
        ``variable_device``; its iteration count and learning rate, which Keras
        creates with the optimizer, live where it was made.
      devices: one device per tower; default every GPU, else the CPU.
      variable_device: where variables live, gradients are combined and applied.
      metrics: Keras metrics (objects or names such as ``"accuracy"``), updated
        with every tower's predictions of the step, so they equal the full-batch
        metric exactly.
      moving_statistics: how BatchNormalization layers update their moving mean
        and variance from the towers' shards, once per step: ``"batch"`` (the
        whole batch's moments, combined exactly), ``"tower0"`` (tower 0's, as
        tf_cnn_benchmarks) or ``"mean"`` (the mean of the towers', as
        MirroredStrategy). See ``towers/batchnorm.py``.
      on_nonfinite: what a step does when a combined gradient has an inf or NaN:
        ``"ignore"`` applies it as Keras does (no check, no cost); ``"skip"``
        applies nothing that step (no variable, slot, iteration count or moving
        statistic changes); ``"raise"`` applies nothing and raises
        ``FloatingPointError`` naming the first such variable. With a
        ``LossScaleOptimizer`` (mixed_float16) the optimizer skips such steps
        and lowers its scale itself; ``"raise"`` is refused there.
      accumulate_steps: apply once every k steps, the examples-weighted mean of
        their gradients: exactly one step on the k batches together (uneven sizes
        included), one optimizer iteration per apply. ``fit`` applies a partial
        window at each epoch's end. Moving statistics update every step. See
        ``towers/update.py``.
      reducer: how the towers' dense gradients are summed: ``"per_tensor"``,
        ``"packed"``, ``"sharded"``, a ``"bf16+"``/``"fp16+"`` cast of one of them,
        or a reducer object; see ``towers/reducers.py``.
      placement: where the variables live: ``"central"`` (all on
        ``variable_device``), ``"balanced"`` (spread over ``devices`` by bytes;
        each variable combined and updated where it lives), ``"replicated"`` (a
        copy per tower, all-reduced with TensorFlow's collective ops) or
        ``"independent"`` (a copy per tower, never synchronised: a measurement
        baseline, not training). All but ``"central"`` need ``model`` as a
        zero-arg function. See ``towers/placement.py``.
      cluster: the worker processes this one trains with: ``"auto"`` (default)
        joins the cluster ``TF_CONFIG`` names, if it is set; a
        :class:`towers.Cluster`; or None for this process alone. In a cluster,
        each worker's towers combine locally, then the workers sum their
        gradients (weighted by each worker's examples) on TensorFlow's
        collective runtime, so W workers × T towers give one process's update on
        the concatenated batch. Feed each worker its share with
        :func:`towers.shard`. Variables start as the chief's. See
        ``towers/cluster.py``.

    Mixed precision: under a ``mixed_float16`` dtype policy the optimizer is wrapped
    in a ``keras.optimizers.LossScaleOptimizer`` (as Keras' ``compile`` does) unless
    it is one already. Each tower's loss is multiplied by the current scale, the
    scaled gradients are combined, and the optimizer unscales them once, checks
    them and applies or skips. ``mixed_bfloat16`` needs no scaling.

    Raises:
      ValueError: unknown or repeated devices, a model that is not a Keras model,
        or variables (model or optimizer) that live off ``variable_device``.

    Example:
      >>> import keras, numpy as np, towers
      >>> eng = towers.Towers(
      ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
      ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
      ...     devices=["/cpu:0", "/cpu:1"])
      >>> x, y = np.ones((5, 3), "float32"), np.zeros((5, 1), "float32")
      >>> logs = eng.train_step(x, y)
      >>> sorted(logs), int(eng.optimizer.iterations.numpy())
      (['loss'], 1)
    """

    def __init__(
        self,
        model: keras.Model | Callable[[], keras.Model],
        loss: Any,
        optimizer: keras.optimizers.Optimizer,
        devices: Sequence[str] | None = None,
        variable_device: str = "/cpu:0",
        metrics: Sequence[Any] | None = None,
        moving_statistics: MovingStatisticsPolicy = "batch",
        on_nonfinite: NonfinitePolicy = "ignore",
        accumulate_steps: int = 1,
        reducer: Any = "per_tensor",
        placement: Placement = "central",
        cluster: Cluster | str | None = "auto",
    ):
        # First: a cluster's runtime must start before TensorFlow initialises.
        self.cluster = resolve_cluster(cluster)
        self.devices = resolve_devices(devices)
        self.reducer = get_reducer(reducer)
        self.placement = check_placement(placement)
        self.variable_device = canonical_device(variable_device)
        self.loss = TowerLoss(loss)
        self.replicas: Replicas | None = None
        self._optimizer_arg = optimizer
        self._builder = model if self.placement != "central" else None
        self.model = self._build_model(model)
        self.moving_statistics = MovingStatistics(self.model, moving_statistics)
        self.optimizer = self._build_optimizer(optimizer)
        self.update = Update(
            self.optimizer,
            self.variable_device,
            on_nonfinite,
            accumulate_steps,
            normalised_by_batch=self.loss.normalised_by_batch,
        )
        with tf.device(self.variable_device):
            self.metrics = [_as_metric(m) for m in metrics or []]
            # Keras' fit reports the epoch's loss as a mean weighted by batch size.
            self.loss_tracker = keras.metrics.Mean(name="loss")
        self._check_replica_options()
        self.workers = self._join_workers()
        self._step_fn = tf.function(self._step)
        self._eval_fn = tf.function(self._eval_step)
        if self.model.built and self.model.variables:
            self._finish_build()

    @property
    def num_towers(self) -> int:
        """How many towers (devices) each step is split over.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> eng.num_towers
          2
        """
        return len(self.devices)

    @property
    def trace_count(self) -> int:
        """How many times the step has been traced (one per input signature).

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> for batch in (4, 4, 5):
          ...     _ = eng.train_step(np.ones((batch, 3), "float32"),
          ...                        np.zeros((batch, 1), "float32"))
          >>> eng.trace_count  # batches of 4 share a trace; 5 needs its own
          2
        """
        return self._step_fn.experimental_get_tracing_count()

    def train_step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        """Runs one training step on a global batch.

        Args:
          x: inputs, a tensor/array or nest of them, B examples on the first axis.
          y: targets, the same B.

        Returns:
          ``{"loss": scalar}``, the full-batch loss before this step's update.

        Raises:
          ValueError: x and y disagree on B, B == 0, or the loss does not return one
            value per example. Nothing is updated when a step fails.
          FloatingPointError: with ``on_nonfinite="raise"``, a combined gradient
            is not finite; nothing was updated.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> x, y = np.zeros((5, 3), "float32"), np.ones((5, 1), "float32")
          >>> logs = eng.train_step(x, y)
          >>> float(logs["loss"])  # the bias starts at 0, so every error is 1
          1.0
          >>> eng.steps_done, int(eng.optimizer.iterations)
          (1, 1)
        """
        x, y = self._prepare(x, y)
        logs = dict(self._run(self._step_fn, x, y))
        self._raise_if_nonfinite(logs.pop(_FINITE, None), logs["loss"])
        return logs

    def apply_accumulated(self) -> None:
        """Applies the gradients of a partly filled ``accumulate_steps`` window.

        ``fit`` calls this at the end of each epoch; a no-op when nothing waits.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"], accumulate_steps=4)
          >>> x, y = np.ones((5, 3), "float32"), np.ones((5, 1), "float32")
          >>> _ = eng.train_step(x, y)  # 1 of 4 micro-batches: nothing applied yet
          >>> int(eng.optimizer.iterations)
          0
          >>> eng.apply_accumulated()
          >>> int(eng.optimizer.iterations)
          1
        """
        self._raise_if_nonfinite(self.update.flush(), None)

    @property
    def steps_done(self) -> int:
        """Steps trained, skipped ones and accumulated micro-batches included.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"], accumulate_steps=2)
          >>> for _ in range(3):
          ...     _ = eng.train_step(np.ones((4, 3), "f4"), np.ones((4, 1), "f4"))
          >>> eng.steps_done, int(eng.optimizer.iterations)  # 3 batches, 1 apply
          (3, 1)
        """
        return 0 if self.update.steps is None else int(self.update.steps.numpy())

    def _raise_if_nonfinite(self, finite: Any, loss: Any) -> None:
        if finite is None or self.update.on_nonfinite != "raise":
            return
        name = first_nonfinite(finite, self.update.applied)
        if name is not None:
            raise FloatingPointError(
                f"the combined gradient of {name!r} is not finite (inf or NaN); "
                "nothing was applied (on_nonfinite='raise'). Received "
                + ("" if loss is None else f"a batch with loss {float(loss)} and ")
                + "gradients with inf or NaN."
            )

    def evaluate_step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        """Updates the loss and metric trackers with one batch; no training.

        Returns:
          The running ``{"loss": mean so far, metric name: value so far}``.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"], metrics=["mae"])
          >>> x = np.zeros((4, 3), "float32")
          >>> _ = eng.evaluate_step(x, np.full((4, 1), 2.0, "float32"))
          >>> logs = eng.evaluate_step(x, np.zeros((4, 1), "float32"))
          >>> float(logs["loss"]), float(logs["mean_absolute_error"])  # y^2, |y|
          (2.0, 1.0)
        """
        x, y = self._prepare(x, y)
        return self._run(self._eval_fn, x, y)

    def _run(self, step: Any, x: Any, y: Any) -> Any:
        """Runs a compiled step; in a cluster, a lost peer is named."""
        if self.workers is None:
            return step(x, y)
        started = time.monotonic()
        try:
            return step(x, y)
        except tf.errors.OpError as error:
            raise_if_lost(self.cluster, error, time.monotonic() - started)
            raise

    def explain(self, x: Any, y: Any) -> Any:
        """Where one step on ``(x, y)`` put every variable and op, as TensorFlow
        placed them (``towers explain``; see ``towers/explain.py``).

        The step really runs, then every variable it touched is put back, so the
        engine is left as it was. In a cluster every worker must call it.

        Returns:
          A ``towers.explain.Explanation``: ``str()`` is the report,
          ``.save_png(path)`` draws it.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> x, y = np.ones((5, 3), "float32"), np.zeros((5, 1), "float32")
          >>> report = eng.explain(x, y)
          >>> report.sizes, report.ran_on("apply"), report.ran_on("tower 1 backward")
          ([3, 2], ['/device:CPU:0'], ['/device:CPU:1'])
          >>> int(eng.optimizer.iterations.numpy())  # explaining did not train
          0
        """
        from towers.explain import explain

        return explain(self, x, y)

    def reset_metrics(self) -> None:
        """Starts the loss tracker and every metric afresh (each epoch does).

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> x, y = np.zeros((4, 3), "float32"), np.ones((4, 1), "float32")
          >>> _ = eng.evaluate_step(x, y)
          >>> float(eng.loss_tracker.result())
          1.0
          >>> eng.reset_metrics()
          >>> float(eng.loss_tracker.result())
          0.0
        """
        for metric in [self.loss_tracker, *self.metrics]:
            metric.reset_state()

    def fit(self, data: Any, **kwargs: Any) -> dict[str, list[float]]:
        """Trains on ``data``; see :func:`towers.loop.fit` for the arguments.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"])
          >>> x = np.random.default_rng(0).random((20, 3)).astype("float32")
          >>> history = eng.fit((x, x.sum(1, keepdims=True)), batch_size=8, epochs=3,
          ...                   verbose=0)
          >>> sorted(history), len(history["loss"]), eng.steps_done  # 3 batches/epoch
          (['loss'], 3, 9)
          >>> history["loss"][-1] < history["loss"][0]
          True
        """
        from towers.loop import fit

        return fit(self, data, **kwargs)

    def evaluate(self, data: Any, **kwargs: Any) -> dict[str, float]:
        """Evaluates on ``data``; see :func:`towers.loop.evaluate`.

        Example:
          >>> import keras, numpy as np, towers
          >>> eng = towers.Towers(
          ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
          ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
          ...     devices=["/cpu:0", "/cpu:1"], metrics=["mae"])
          >>> x, y = np.zeros((10, 3), "float32"), np.full((10, 1), 3.0, "float32")
          >>> eng.evaluate((x, y), batch_size=4, verbose=0)  # bias 0: predicts 0
          {'loss': 9.0, 'mean_absolute_error': 3.0}
        """
        from towers.loop import evaluate

        return evaluate(self, data, **kwargs)

    def _prepare(self, x: Any, y: Any):
        x_size, y_size = batch_size_of(x), batch_size_of(y)
        if x_size != y_size:
            raise ValueError(
                "x and y must have the same batch size; received x with "
                f"{x_size} examples and y with {y_size}"
            )
        if x_size == 0 and self.cluster is None:
            # A worker of a cluster may get no examples of a small batch; it
            # still joins the step's collectives, with zeros.
            raise ValueError("a batch needs at least one example; received 0")
        with tf.device(_HOST):
            x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        if not self.model.variables:
            self._build_from_batch(x)
        return x, y

    # -- the step -----------------------------------------------------------------

    def _step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        if self.workers is not None:
            return self._step_in_cluster(x, y)
        global_batch, towers = self._compute(x, y)
        tower_losses, tower_grads, tower_preds, tower_moments = towers
        with tf.device(self.variable_device), tf.name_scope("combine"):
            loss = tf.add_n(tower_losses)
        grads = self._combine(tower_grads)
        # Every tower (and every check in it) has finished before any update.
        with tf.control_dependencies([loss]):
            finite = self._apply(grads, tower_moments, global_batch)
        logs = self._track(loss, global_batch, y, tower_preds, batch_loss=True)
        if finite is not None:
            logs[_FINITE] = finite
        return logs

    def _step_in_cluster(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        """The step of one worker: local towers, local combine, then the sum of
        every worker's gradients, loss, examples and metric updates."""
        local_batch, towers = self._compute(x, y)
        tower_losses, tower_grads, tower_preds, tower_moments = towers
        with tf.device(self.variable_device), tf.name_scope("combine"):
            loss = tf.add_n(tower_losses)
        grads = self._combine(tower_grads)
        grads, loss, global_batch = self._across_workers(
            grads, loss, local_batch, y, tower_preds, "train"
        )
        with tf.control_dependencies([loss]):
            finite = self._apply(grads, tower_moments, global_batch)
        logs = self._track_global(loss, global_batch, batch_loss=True)
        if finite is not None:
            # The same on every worker: they apply the same summed gradients.
            logs[_FINITE] = finite
        return logs

    def _across_workers(self, grads, loss, local_batch, y, tower_preds, kind):
        """Sums this worker's gradients, loss and metric updates with the others'.

        Metrics are updated with this worker's predictions, and the change is
        summed across workers: every worker's metric then holds the cluster's.
        """
        with tf.device(self.variable_device), tf.name_scope("across_workers"):
            variables = [v for m in self.metrics for v in m.variables]
            before = [tf.convert_to_tensor(v) for v in variables]
            if self.metrics:
                self._update_metrics(y, tower_preds)
            changes = [tf.convert_to_tensor(v) - b for v, b in zip(variables, before)]
            grads, loss, global_batch, changes = self.workers.step(
                grads, loss, local_batch, changes, self.loss.normalised_by_batch, kind
            )
            for var, old, change in zip(variables, before, changes):
                var.assign(old + change)
        return grads, loss, global_batch

    def _track_global(self, loss, global_batch, batch_loss: bool) -> dict:
        """Loss and metric results once metrics hold the whole cluster's state."""
        with tf.device(self.variable_device), tf.name_scope("metrics"):
            self.loss_tracker.update_state(
                loss, sample_weight=tf.cast(global_batch, tf.float32)
            )
            logs = {"loss": loss if batch_loss else self.loss_tracker.result()}
            for metric in self.metrics:
                logs[metric.name] = metric.result()
        return logs

    # The step's three phases, also timed one by one (towers/bench/phases.py).

    def _compute(self, x: Any, y: Any):
        """Every working tower's forward and backward pass.

        Returns:
          ``(B, (losses, grads, predictions, moments))``, one entry per tower.
        """
        global_batch, shards = self._split(x, y)
        norm = self._normaliser(global_batch)
        towers = [], [], [], []
        for t, device in self._working_towers(global_batch):
            with tf.device(device), tf.name_scope(f"tower_{t}"):
                results = self._tower(self._model_of(t), *shards[t], norm)
            for collected, result in zip(towers, results):
                collected.append(result)
        return global_batch, towers

    def _combine(self, tower_grads: list[list[Any]]) -> list[Any]:
        """Shared variables: one sum per variable, each on its variable's device.
        A copy per tower: each tower's list of sums (replicated) or its own
        gradients (independent)."""
        if self.replicas is not None:
            return self.replicas.reduce(tower_grads)
        combined: list[Any] = [None] * len(tower_grads[0])
        for device, indices in self._groups_by_device():
            with tf.device(device), tf.name_scope("combine"):
                part = combine_gradients(
                    [[grads[v] for v in indices] for grads in tower_grads],
                    reduction="sum",
                    reducer=self.reducer,
                )
            for v, grad in zip(indices, part):
                combined[v] = grad
        return combined

    def _apply(self, grads: list[Any], tower_moments: list, global_batch: Any):
        """Applies the combined gradients; returns the finiteness flags or None."""
        if self.replicas is not None:
            self.update.steps.assign_add(1)
            self.replicas.apply(grads)
            return None
        with tf.device(self.variable_device), tf.name_scope("apply"):
            with self._placing_updates():
                return self.update.apply(
                    grads,
                    also=lambda: self.moving_statistics.update(tower_moments),
                    global_batch=global_batch,
                    has_regularisers=bool(self.model.losses),
                )

    def _groups_by_device(self) -> list[tuple[str, list[int]]]:
        """(device, indices of the trainable variables on it), devices in order;
        one group, the variable device, unless balanced."""
        variables = self.model.trainable_variables
        if self.placement != "balanced":
            return [(self.variable_device, list(range(len(variables))))]
        groups: dict[str, list[int]] = {}
        for v, var in enumerate(variables):
            groups.setdefault(self._var_devices[id(var)], []).append(v)
        return list(groups.items())

    def _placing_updates(self):
        if self.placement == "balanced":
            return updates_where_variables_live(self.optimizer)
        return contextlib.nullcontext()

    def _model_of(self, t: int) -> keras.Model:
        return self.model if self.replicas is None else self.replicas.models[t]

    def _eval_step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        global_batch, shards = self._split(x, y)
        norm = self._normaliser(global_batch)
        tower_losses, tower_preds = [], []
        for t, device in self._working_towers(global_batch):
            with tf.device(device), tf.name_scope(f"tower_{t}"):
                loss_t, y_pred = self._forward(
                    self._model_of(t), *shards[t], norm, False
                )
            tower_losses.append(loss_t)
            tower_preds.append(y_pred)
        with tf.device(self.variable_device), tf.name_scope("combine"):
            loss = tf.add_n(tower_losses)
        if self.workers is not None:
            _, loss, global_batch = self._across_workers(
                [], loss, global_batch, y, tower_preds, "eval"
            )
            return self._track_global(loss, global_batch, batch_loss=False)
        return self._track(loss, global_batch, y, tower_preds, batch_loss=False)

    def _normaliser(self, batch: Any) -> Any:
        """What tower losses divide by: the batch, or in a cluster this worker's
        share of it (at least 1: a worker may get no examples)."""
        if self.workers is None:
            return batch
        return max(batch, 1) if isinstance(batch, int) else tf.maximum(batch, 1)

    def _split(self, x: Any, y: Any):
        with tf.device(_HOST), tf.name_scope("split"):
            size = batch_size_of(x)
            if isinstance(size, int) and size == 0:
                # Only a worker of a cluster gets an empty share (see _prepare).
                return 0, [(x, y)] * self.num_towers
            return size, split_batch((x, y), self.num_towers)

    def _working_towers(self, global_batch: Any):
        """(tower id, device) of every tower that gets examples in this step."""
        sizes = (
            split_sizes(global_batch, self.num_towers)
            if isinstance(global_batch, int)
            else [None] * self.num_towers
        )
        # B < T: the towers past B have no examples and build no ops at all, but
        # with a copy per tower every tower joins the step (with zeros).
        if self.replicas is not None:
            return list(enumerate(self.devices))
        working = [(t, d) for t, d in enumerate(self.devices) if sizes[t] != 0]
        # A worker with no examples still sends (zero) gradients to the others.
        return working or [(0, self.devices[0])]

    def _track(self, loss, global_batch, y, tower_preds, batch_loss: bool) -> dict:
        """Updates loss and metrics with the whole batch's predictions."""
        with tf.device(self.variable_device), tf.name_scope("metrics"):
            self.loss_tracker.update_state(
                loss, sample_weight=tf.cast(global_batch, tf.float32)
            )
            logs = {"loss": loss if batch_loss else self.loss_tracker.result()}
            if self.metrics:
                self._update_metrics(y, tower_preds)
                for metric in self.metrics:
                    logs[metric.name] = metric.result()
        return logs

    def _update_metrics(self, y: Any, tower_preds: list) -> None:
        # Towers' predictions in tower order are the batch's predictions.
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *tower_preds
        )
        for metric in self.metrics:
            metric.update_state(y, y_pred)

    def _forward(self, model, x_t: Any, y_t: Any, global_batch: Any, training: bool):
        """One tower's predictions and its share of the full-batch loss."""
        y_pred = model(x_t, training=training)
        loss_t = self.loss.tower_loss(y_t, y_pred, global_batch)
        if model.losses:
            # Regularisers are per-batch means in Keras 3: weight by n_t / B so
            # the towers' shares add up to the full batch's one.
            share = tf.cast(batch_size_of(x_t), tf.float32) / tf.cast(
                global_batch, tf.float32
            )
            loss_t += tf.add_n(model.losses) * share
        return loss_t, y_pred

    def _tower(self, model, x_t: Any, y_t: Any, global_batch: Any):
        """One tower: its loss share, gradients, predictions and BN moments.

        Under loss scaling the gradients are of ``scale * loss_t``; the optimizer
        divides their combination by the scale once.
        """
        with tf.GradientTape() as tape, self.moving_statistics.recording() as moments:
            loss_t, y_pred = self._forward(model, x_t, y_t, global_batch, True)
            scaled = self.update.scale_loss(loss_t)
        grads_t = tape.gradient(scaled, model.trainable_variables)
        return loss_t, grads_t, y_pred, moments

    # -- building and placement ---------------------------------------------------

    def _build_model(self, model: Any) -> keras.Model:
        if self.placement != "central":
            return self._build_placed(model)
        if not isinstance(model, keras.Model) and callable(model):
            with tf.device(self.variable_device):
                model = model()
        if not isinstance(model, keras.Model):
            raise ValueError(
                "model must be a Keras model or a zero-arg function that builds one; "
                f"received {model!r}"
            )
        return model

    def _build_placed(self, build: Any, sample: Any = None) -> keras.Model:
        """The model of a balanced placement, or copy 0 of a replicated one."""
        if isinstance(build, keras.Model) or not callable(build):
            raise ValueError(
                f"placement={self.placement!r} builds the model itself: model must "
                f"be a zero-arg function that builds one; received {build!r}"
            )
        if self.placement == "balanced":
            with tf.device(self.variable_device):
                return build_balanced(build, self.devices, sample)
        self.replicas = Replicas(
            build, self._optimizer_arg, self.devices, self.placement, self.reducer
        )
        return self.replicas.models[0]

    def _build_optimizer(self, optimizer: Any) -> keras.optimizers.Optimizer:
        if self.replicas is not None:
            return self.replicas.optimizers[0]
        if not isinstance(optimizer, keras.optimizers.Optimizer) and callable(
            optimizer
        ):
            with tf.device(self.variable_device):
                optimizer = optimizer()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "optimizer must be a keras.optimizers.Optimizer or a zero-arg function "
                f"that makes one; received {optimizer!r}"
            )
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if self.model.dtype_policy.name == "mixed_float16" and not scaled:
            # As Keras' compile does: float16 gradients underflow without it.
            with tf.device(self.variable_device):
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        return optimizer

    def _build_from_batch(self, x: Any) -> None:
        """Creates a lazily built model's variables from one example."""
        sample = tf.nest.map_structure(lambda a: a[:1], x)
        if self.placement == "balanced":
            # The plan needs every variable's size: build it again, placed.
            self.model = self._build_placed(self._builder, sample)
            self.moving_statistics = MovingStatistics(
                self.model, self.moving_statistics.policy
            )
        elif self.replicas is not None:
            self.replicas.build(sample)
        else:
            with tf.device(self.variable_device):
                self.model(sample, training=False)
        self._finish_build()

    def _finish_build(self) -> None:
        if self.replicas is not None:
            self.replicas.build()
        elif not self.optimizer.built:
            with tf.device(self.variable_device):
                self.optimizer.build(self.model.trainable_variables)
        self.update.build(self.model.trainable_variables)
        self._var_devices = {id(v): v.handle.device for v in self.model.variables}
        self._check_placement()
        if self.workers is not None:
            self._start_together()

    def _join_workers(self) -> WorkerReduce | None:
        """The cross-worker sums of a cluster; what a cluster cannot do yet."""
        if self.cluster is None:
            return None
        unsupported = {
            f"placement={self.placement!r}": self.placement != "central",
            "BatchNormalization layers": bool(self.moving_statistics.layers),
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(
                    f"a cluster of workers does not support {what} yet; received "
                    "them together. Use placement='central' and no "
                    "BatchNormalization, or one process."
                )
        return WorkerReduce(self.cluster, self.variable_device)

    def _start_together(self) -> None:
        """Every worker checks it built the chief's model, then takes its values."""
        self.workers.check_same(
            [
                (
                    v.path,
                    v.dtype if isinstance(v.dtype, str) else v.dtype.name,
                    str(tuple(v.shape)),
                )
                for v in self.model.variables
            ]
        )
        self.workers.broadcast(self.model.variables)

    def _check_placement(self) -> None:
        """Every model and optimizer variable is where the placement says."""
        if self.replicas is None:
            copies = [(self.model, self.optimizer, self.variable_device)]
        else:
            copies = zip(self.replicas.models, self.replicas.optimizers, self.devices)
        for model, optimizer, device in copies:
            owners = {
                v.path.replace("/", "_"): v.handle.device for v in model.variables
            }
            for var in model.variables:
                self._check_on(var, "model", self._expected_device(var, device))
            for slot in _slot_variables(optimizer):
                # Keras names a slot after its variable's path and colocates it.
                owner = max(
                    (k for k in owners if slot.name.startswith(k + "_")),
                    key=len,
                    default=None,
                )
                expected = (
                    owners[owner] if owner and self.placement == "balanced" else device
                )
                self._check_on(slot, "optimizer slot", expected)

    def _expected_device(self, var: Any, device: str) -> str:
        if self.placement != "balanced":
            return device
        own = var.handle.device
        return (
            own if any(same_device(own, d) for d in self.devices) else self.devices[0]
        )

    def _check_on(self, var: Any, owner: str, expected: str) -> None:
        device = var.handle.device
        if not same_device(device, expected):
            name = getattr(var, "path", var.name)
            where = (
                f"the variable device {expected}"
                if self.placement == "central"
                else f"{expected} (placement={self.placement!r})"
            )
            raise ValueError(
                f"{owner} variables must live on {where}; received {name!r} on "
                f"{device}. "
                "Pass a zero-arg function that builds the model (towers builds it "
                f"there), or build it inside `with tf.device({expected!r})`."
            )

    def _check_replica_options(self) -> None:
        """A copy per tower supports the plain step only; say so up front."""
        if self.replicas is None:
            return
        unsupported = {
            "accumulate_steps > 1": self.update.accumulate_steps > 1,
            f"on_nonfinite={self.update.on_nonfinite!r}": self.update.checks,
            "BatchNormalization layers": bool(self.moving_statistics.layers),
            "mixed_float16 (loss scaling)": self.model.dtype_policy.name
            == "mixed_float16",
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(
                    f"placement={self.placement!r} does not support {what} yet; "
                    "received them together. Use placement='central' or 'balanced'."
                )


def _slot_variables(optimizer: Any) -> list:
    """The optimizer's variables except the scalars Keras made with it."""
    optimizers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    own = {
        id(v)
        for opt in optimizers
        if opt is not None
        for v in (opt.iterations, opt._learning_rate)
    }
    return [v for v in optimizer.variables if id(v) not in own]


def _as_metric(metric: Any) -> keras.metrics.Metric:
    if isinstance(metric, str):
        # Keras resolves "accuracy" by the loss at compile time; here the name must
        # say which one (e.g. "sparse_categorical_accuracy").
        metric = keras.metrics.get(metric)
        if not isinstance(metric, keras.metrics.Metric):
            metric = keras.metrics.MeanMetricWrapper(metric, name=metric.__name__)
    if not isinstance(metric, keras.metrics.Metric):
        raise ValueError(
            "metrics must be keras.metrics.Metric objects or names; "
            f"received {metric!r}"
        )
    return metric

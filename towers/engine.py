"""Towers, the front door: the arguments resolved into the step's parts, and
the data path of ``step/step.py`` run as one ``tf.function`` (architecture.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import keras
import tensorflow as tf

from towers.cluster.cluster import Cluster
from towers.devices import canonical_device, resolve_devices
from towers.explain.run import Explanation, explain
from towers.parts import PlacementName, join_cluster, make_step
from towers.placement.update import NonfinitePolicy
from towers.reducers import get_reducer
from towers.step.rules.batchnorm import BatchStatistics, MovingStatisticsPolicy
from towers.step.run.xla import JitCompile
from towers.training.check_schedule import SPOT_CHECKS, Checks
from towers.training.comparison import Comparison
from towers.training.compiled import Compiled
from towers.training.compiling import FROM_COMPILE
from towers.training.fits import named_misfits
from towers.training.loop import Trainer
from towers.training.recompile import remember_compile


class Towers(Trainer):
    """Data-parallel training with one tower per device and shared variables.

    Args:
      model: a Keras model, or a zero-arg function that builds one (called
        under ``variable_device``, where the variables must live).
      loss, optimizer: a ``keras.losses.Loss``, a loss name or a function
        ``(y_true, y_pred) -> per-example losses``; a Keras optimizer, its name
        or a zero-arg function making one (slots live with the variables).
        Default: the model's compile's; neither: it predicts (training/compiling.py).
      devices: one device per tower; default every GPU, else the CPU.
      variable_device: where variables live, gradients are combined and applied.
      metrics, weighted_metrics, loss_weights: as ``model.compile`` takes them;
        metrics see every tower's predictions: the full batch's.
      moving_statistics: how BatchNormalization's moving statistics move once
        a step: ``"batch"``, ``"tower0"``, ``"mean"`` (``step/rules/batchnorm.py``).
      batch_statistics: BatchNormalization normalises with the whole batch's
        statistics (``"global"``, the default where the towers share a model)
        or each shard's (``"tower"``, for speed; not a ``synchronized`` layer).
      on_nonfinite: a gradient with inf or NaN is applied (``"ignore"``, as
        Keras), or nothing is (``"skip"``; ``"raise"`` then names it).
      accumulate_steps: apply once every k steps their examples-weighted mean
        gradient: exactly one step on the k batches together.
      reducer: how dense gradients are summed (``towers/reducers.py``).
      placement: ``"central"``, ``"balanced"``, ``"replicated"``, ``"independent"``.
      cluster: ``"auto"`` (``TF_CONFIG``'s), a :class:`towers.Cluster` or None.
      jit_compile: each tower's pass as XLA computations: True, False, or
        ``"auto"``; None: the compiled model's (``towers/step/run/xla.py``).
      coupled_losses: a loss term coupling the batch's examples is made exact
        (``"exact"``), per tower (``"per_tower"``) or refused (step/rules/coupled.py).
      steps_per_execution: fit's steps per call (a loop in the graph), as
        ``compile`` takes it; None: the compiled model's, else 1.
      tower_functions: each tower's pass ``"inline"`` (the fastest steps) or a
        ``"call"`` of its own: quicker to a first step, slower after.
      check_first_step, spot_checks: before the first update and each new
        trace's, and every ``spot_checks`` steps (None: not), refuse by name a
        step unlike one device's on its batch (``training/check.py``).

    Attributes:
      model, optimizer, metrics: the Keras model, optimizer (tower 0's), metrics.
      placement, update, step, workers, checks: the parts (architecture.md).

    Raises:
      ValueError: unknown devices, not a Keras model (or builder), variables off
        their placement, an option refused: each names what it received.

    Example:
      >>> import keras, numpy as np, towers
      >>> eng = towers.Towers(
      ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
      ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
      ...     devices=["/cpu:0", "/cpu:1"])
      >>> logs = eng.train_step(np.ones((5, 3), "f4"), np.zeros((5, 1), "f4"))
      >>> sorted(logs), int(eng.optimizer.iterations.numpy())
      (['loss'], 1)
    """

    def __init__(
        self,
        model: keras.Model | Callable[[], keras.Model],
        loss: Any = FROM_COMPILE,
        optimizer: Any = FROM_COMPILE,
        devices: Sequence[str] | None = None,
        variable_device: str = "/cpu:0",
        metrics: Sequence[Any] | None = None,
        moving_statistics: MovingStatisticsPolicy = "batch",
        batch_statistics: BatchStatistics | None = None,
        on_nonfinite: NonfinitePolicy = "ignore",
        accumulate_steps: int = 1,
        reducer: Any = "per_tensor",
        placement: PlacementName = "central",
        cluster: Cluster | str | None = "auto",
        loss_weights: Any = None,
        weighted_metrics: Sequence[Any] | None = None,
        jit_compile: JitCompile = None,
        coupled_losses: Literal["exact", "per_tower", "refuse"] = "exact",
        steps_per_execution: int | None = None,
        tower_functions: Literal["inline", "call"] = "inline",
        check_first_step: bool = True,
        spot_checks: int | None = SPOT_CHECKS,
    ):
        # First: a cluster's runtime must start before TensorFlow initialises.
        self.cluster = join_cluster(cluster, model, optimizer)
        self.devices = resolve_devices(devices)
        self.variable_device = canonical_device(variable_device, "variable_device")
        self.reducer = get_reducer(reducer)
        self.checks = Checks(self, check_first_step, spot_checks)
        options = dict(
            metrics=metrics, weighted_metrics=weighted_metrics,
            loss_weights=loss_weights, moving_statistics=moving_statistics,
            batch_statistics=batch_statistics, on_nonfinite=on_nonfinite,
            accumulate_steps=accumulate_steps, jit_compile=jit_compile,
            coupled_losses=coupled_losses, steps_per_execution=steps_per_execution,
            tower_functions=tower_functions,
        )  # fmt: skip
        where = (self.devices, self.variable_device, self.reducer, placement)
        self.step = make_step(model, loss, optimizer, *where, self.cluster, options)
        self.placement, self.update = self.step.placement, self.step.update
        self.workers = self.step.workers
        self.moving_statistics = self.step.moving_statistics
        self.model, self.optimizer = self.placement.model, self.placement.optimizer
        self._compiled = Compiled(self.step)
        remember_compile(self, locals())  # what a later compile changes
        if self.model.built and self.model.variables:
            self.step.start()  # else the first batch builds the model first

    @property
    def num_towers(self) -> int:
        """How many towers (devices) each step is split over.

        >>> make_engine().num_towers
        2"""
        return len(self.devices)

    @property
    def trace_count(self) -> int:
        """How many times the step has been traced (one per input signature).

        >>> eng = make_engine()
        >>> for batch in (4, 4, 5):
        ...     _ = eng.train_step(np.ones((batch, 3), "f4"), np.ones((batch, 1), "f4"))
        >>> eng.trace_count  # batches of 4 share a trace; 5 needs its own
        2"""
        return self._compiled.train_traces

    @property
    def steps_done(self) -> int:
        """Steps trained, skipped ones and accumulated micro-batches included.

        >>> eng = make_engine(accumulate_steps=2)
        >>> for _ in range(3):
        ...     _ = eng.train_step(np.ones((4, 3), "f4"), np.ones((4, 1), "f4"))
        >>> eng.steps_done, int(eng.optimizer.iterations)  # 3 batches, 1 apply
        (3, 1)"""
        return 0 if self.update.steps is None else int(self.update.steps.numpy())

    def train_step(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> dict[str, tf.Tensor]:
        """Runs one training step on a global batch.

        Args:
          x, y, sample_weight: inputs, targets (None for a model that adds its
            own loss) and weights (or None): B examples on the first axis.

        Returns:
          ``{"loss": the batch's loss before the update, metric: running value}``.

        Raises:
          ValueError: x, y and sample_weight disagree on B, B == 0, the batch
            does not fit (``training/fits.py``), a term couples the examples
            (``step/rules/probe.py``), or a checked step is unlike one device's.
          FloatingPointError: a gradient not finite under ``"raise"``; none applied.

        Example:
          >>> eng = make_engine()
          >>> x, y = np.zeros((5, 3), "float32"), np.ones((5, 1), "float32")
          >>> loss = float(eng.train_step(x, y)["loss"])  # the bias starts at 0
          >>> loss, eng.steps_done, int(eng.optimizer.iterations)  # errors of 1
          (1.0, 1, 1)"""
        return self.train_steps([(x, y, sample_weight)])

    def train_steps(self, batches: list[tuple]) -> dict[str, tf.Tensor]:
        """A step on each ``(x, y, sample_weight)`` of ``batches`` in order (those
        of one shape in one call: ``training/executions.py``); the last's logs.

        >>> eng, x = make_engine(), np.ones((4, 3), "f4")
        >>> logs = eng.train_steps([(x, np.ones((4, 1), "f4"))] * 3)
        >>> eng.steps_done, eng.trace_count  # 3 steps, one trace of the loop
        (3, 1)"""
        return self.fit_steps(batches)["logs"]

    def fit_steps(self, batches: list[tuple]) -> dict[str, Any]:
        """:meth:`train_steps`' whole output: ``"logs"``, and what Keras'
        ``train_step`` returns for its callbacks, ``"reported"`` (the loss's
        running mean, or a model's own step's logs).

        >>> out = make_engine().fit_steps([(np.zeros((4, 3)), np.ones((4, 1)))] * 2)
        >>> [round(float(out[key]["loss"]), 4) for key in ("logs", "reported")]
        [0.64, 0.82]"""
        prepared = [self._training_batch("train_step", *b) for b in batches]
        with named_misfits(self.model, prepared[0], towers=self.num_towers):
            return self.checks.run(prepared)  # where due: check_schedule.py

    def _run_steps(self, prepared: list[tuple]) -> dict:  # unchecked
        return self._compiled.train_on(prepared, self._call)

    def evaluate_step(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> dict[str, tf.Tensor]:
        """Updates the loss and metrics with one batch; no training.

        Returns:
          The running ``{"loss": mean so far, metric name: value so far}``.

        >>> eng, x = make_engine(metrics=["mae"]), np.zeros((4, 3), "float32")
        >>> _ = eng.evaluate_step(x, np.full((4, 1), 2.0, "float32"))
        >>> logs = eng.evaluate_step(x, np.zeros((4, 1), "float32"))
        >>> float(logs["loss"]), float(logs["mae"])  # y^2, |y|
        (2.0, 1.0)"""
        batch = self._training_batch("evaluate_step", x, y, sample_weight)
        return self._run("evaluate", *batch)

    def predict_step(self, x: Any) -> Any:
        """The model's outputs on one batch: each tower predicts its shard; the
        outputs are concatenated in order (``predict`` feeds many batches).

        >>> make_engine().predict_step(np.zeros((3, 3), "f4")).shape  # bias 0
        TensorShape([3, 1])"""
        x, _, _ = self.prepare(x)
        return self._run("predict", x)

    def apply_accumulated(self) -> None:
        """Applies the gradients of a partly filled ``accumulate_steps`` window
        (``fit`` does at each epoch's end); a no-op when nothing waits.

        >>> eng = make_engine(accumulate_steps=4)
        >>> _ = eng.train_step(np.ones((5, 3), "f4"), np.ones((5, 1), "f4"))
        >>> eng.apply_accumulated(); int(eng.optimizer.iterations)  # 1 of 4 batches
        1"""
        self.step.flush()

    def prepare(self, x: Any, y: Any = None, sample_weight: Any = None, kind=""):
        """A batch checked for ``kind``, on the host, an unbuilt model built.

        >>> x, y, sw = make_engine().prepare(np.ones((2, 3)), np.ones((2, 1)))
        >>> x.device, tuple(y.shape), sw
        ('/job:localhost/replica:0/task:0/device:CPU:0', (2, 1), None)"""
        batch = self.step.prepare(x, y, sample_weight, kind)
        self.model = self.placement.model  # a balanced placement builds anew
        return batch

    def training_state(self) -> dict[str, Any]:
        """What a checkpoint saves: model, optimizer, and the update's state.

        >>> sorted(make_engine(accumulate_steps=2).training_state())
        ['accumulator', 'model', 'optimizer', 'steps_done']"""
        return {"model": self.model, "optimizer": self.optimizer, **self.step.state()}

    def after_restore(self) -> None:
        """Brings every tower's copy (if any) to a restored checkpoint.

        >>> eng = make_engine(placement="replicated")
        >>> _ = eng.model.weights[1].assign([5.0])  # as a restore writes copy 0
        >>> eng.after_restore(); float(eng.placement.models[1].weights[1][0])
        5.0"""
        self.placement.after_restore()
        self.checks.restored()

    def check(self, x: Any, y: Any = None, sample_weight: Any = None) -> Comparison:
        """Towers' step on one batch against the model's own ``train_step`` on
        one device, every variable's difference; nothing kept (``print`` it).

        >>> c = make_engine().check(np.ones((5, 3), "f4"), np.zeros((5, 1), "f4"))
        >>> len(c.differences), c.differs  # kernel, bias, optimizer's, loss's
        (5, [])"""
        return self.checks.check([self._training_batch("check", x, y, sample_weight)])

    def explain(self, x: Any, y: Any) -> Explanation:
        """Where one step on ``(x, y)`` ran (:func:`towers.explain.run.explain`).

        >>> make_engine().explain(np.ones((5, 3), "f4"), np.zeros((5, 1), "f4")).sizes
        [3, 2]"""
        self._training_batch("explain", x, y)
        return explain(self, x, y)

    def _run(self, kind: str, *batch: Any) -> Any:
        with named_misfits(self.model, (*batch, None, None)[:3]):
            return self._compiled.run(kind, self._call, *batch)

    def _call(self, step: Any, *batch: Any) -> Any:  # in a cluster, all together
        return self.workers.run(step, *batch) if self.workers else step(*batch)

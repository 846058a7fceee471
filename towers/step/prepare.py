"""What a step needs before its first run, on the first batch: the batch
checked and put on the host, the model built as Keras' fit builds it, the
parts made ready (:meth:`Preparing.start`), the loss terms probed and the
compiled metrics built. :class:`towers.step.step.Step` takes them."""

from __future__ import annotations

import warnings
from typing import Any

from towers._keras import built_symbolically, trainable_capable
from towers.split import examples_of, split_sizes
from towers.step.batches import check_sizes, check_targets, first_example, on_host
from towers.step.run import xla
from towers.step.work.copies import build_copies
from towers.step.work.hooks import overrides


class Preparing:
    """The first batch's work of a :class:`~towers.step.step.Step`."""

    def start(self) -> None:
        """Makes the parts ready once the model has its variables: the
        optimizers' slots, the update's counters, the placement's device checks,
        and in a cluster the chief's values on every worker."""
        # Keras callbacks (LearningRateScheduler...) find it there, as on compile.
        self.placement.model.optimizer = self.placement.optimizer
        self.started = True
        if not self.owns("train") or len(self.placement.models) > 1:
            # An own train_step's optimizers build at their first apply (Keras').
            self.placement.build_slots()
        self.update.build(trainable_capable(self.placement.model))
        self.placement.check_devices()
        if self.workers is not None:
            self.workers.start_together(self.placement.model.variables)

    def probe(
        self, x: Any, y: Any, sample_weight: Any = None, training: bool = True
    ) -> None:
        """Before the first training step (or evaluation, ``training`` False):
        the model's loss terms that are not a mean over the examples gathered,
        refused by name or warned of (``towers/step/rules/coupled.py``); a no-op
        after."""
        coupled, jit, model = (
            self.builtin.coupled,
            self.builtin.jit,
            self.placement.model,
        )
        batch, own = (x, y, sample_weight), self.builtin.own_loss
        learned = self.runner.learned  # what the step's traces read of it
        coupled.probe(model, batch, own, self.device, jit.strict, training, learned)
        if coupled.gathered and jit.enabled:  # "auto": gathered rows, in turns
            self.builtin.jit = xla.without("the model's compute_loss gathers the batch")
        if self.own is not None:
            self.own.probe(batch, training)

    def build_metrics(self, x, y=None, sample_weight=None, training=True) -> None:
        """Before a first training (or evaluation) step: its targets checked
        against the loss where towers' own step computes it (a model's own
        step reads its data itself), the compiled metrics built from its
        shapes (tensors or ``tf.TensorSpec``), as Keras' fit does."""
        own = self.owns("train" if training else "evaluate")
        if not own:
            check_targets(self.builtin.loss, y)
        # Else built by the step, as in Keras' fit; a model with no call()
        # is never called to build them (keras.io's forward-forward).
        if not own or (y is not None and overrides(self.placement.model, "call")):
            self.metrics.build(x, y, sample_weight)
        if self.own is not None:  # a copy per tower: each copy's too
            build_copies(self.placement, x, y, sample_weight)

    def whole_batch_loss(self, x: Any, y: Any, sample_weight: Any = None) -> bool:
        """After a loss gave one value for the batch while the step was traced
        (``losses.OneValue``, nothing updated): the step takes Keras'
        ``compute_loss`` of the whole batch instead, with the compiled loss,
        gathered (its per-output trackers see the batch's; the probe runs
        again on this batch). False if it did already: the error stands."""
        if self.builtin.own_loss:
            return False
        self.builtin.own_loss = True
        self.builtin.coupled.probe_again()
        self.builtin.coupled.gather_compute_loss()
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
        apart = self.owns(kind)
        check_sizes(x, y, sample_weight, self.workers is not None, apart)
        x, y, sample_weight = on_host((x, y, sample_weight))
        model = self.placement.model
        unbuilt = not model.built or not (model.variables or built_symbolically(model))
        if apart:  # by the model's own step as it first runs, as in Keras' fit
            self.own.build((x, y, sample_weight), kind)
        elif unbuilt and overrides(model, "call"):
            # Built from the first batch, as Keras' fit builds it, whatever
            # variables it made already; one with no call() is never called.
            self.placement.build_from(first_example(x))
        if not self.started:
            self.start()
        self._say_idle(x)
        return x, y, sample_weight

    def _say_idle(self, x: Any) -> None:
        """Warns where the first batch leaves towers idle: fewer examples
        than towers (an epoch's last, partial batch is not the batch size
        chosen; in a cluster a worker's share may be small)."""
        if self._sized:
            return
        self._sized = True
        towers, rows = len(self.placement.devices), examples_of(x)
        if self.workers is None and isinstance(rows, int) and rows < towers:
            warnings.warn(
                f"a batch of {rows} examples on {towers} towers leaves "
                f"{towers - rows} of them idle (shards of "
                f"{split_sizes(rows, towers)}): a step uses every tower from "
                f"{towers} examples on (a batch_size of {towers} or more).",
                stacklevel=4,
            )

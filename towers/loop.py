"""fit, evaluate and predict: feed global batches from tf.data to an engine.

What Keras' ``fit`` gives, on top of the engine's placement and exactness: Keras'
data forms (arrays with ``batch_size``, datasets of ``x``, ``(x, y)`` or ``(x, y,
sample_weight)``, ``sample_weight`` and ``class_weight``), a progress bar per
epoch, a ``History``, Keras callbacks, validation, and checkpoints that resume
where a killed run stopped (see ``checkpoint.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.checkpoint import TrainingCheckpoint, position_iterator
from towers.data import as_dataset, unpack
from towers.preemption import Preemption
from towers.progress import History, Progress
from towers.summaries import TrainingLog


class Trainer(abc.ABC):
    """``fit``, ``evaluate`` and ``predict`` on top of an engine's steps, as
    Keras' ``Trainer`` gives them to a backend's ``train_step``. ``towers.Towers``
    is one.

    Besides the methods below, ``fit`` reads ``model`` (callbacks see it),
    ``loss_tracker`` and ``metrics`` (Keras metrics), ``cluster`` (None, or a
    ``towers.Cluster``: its chief alone reports and writes), ``workers`` (None,
    or its link to them: a preemption notice rides in its sums), and what checkpoints
    and logs need: ``variable_device``, ``optimizer``, ``steps_done``,
    ``training_state()``, ``after_restore()`` (``towers/checkpoint.py``,
    ``towers/summaries.py``).
    """

    @abc.abstractmethod
    def prepare(self, x: Any, y: Any = None, sample_weight: Any = None) -> tuple:
        """Checks a batch and builds a lazily built model from it."""

    @abc.abstractmethod
    def train_step(self, x: Any, y: Any = None, sample_weight: Any = None) -> dict:
        """One training step; returns the batch's loss and the metrics."""

    @abc.abstractmethod
    def evaluate_step(self, x: Any, y: Any = None, sample_weight: Any = None) -> dict:
        """Updates the loss and metrics with one batch."""

    @abc.abstractmethod
    def predict_step(self, x: Any) -> Any:
        """The model's outputs on one batch."""

    @abc.abstractmethod
    def apply_accumulated(self) -> None:
        """Applies a partly filled accumulation window."""

    def reset_metrics(self) -> None:
        """Starts the loss tracker and every metric afresh (each epoch does).

        >>> eng = make_engine()
        >>> _ = eng.evaluate_step(np.zeros((4, 3), "f4"), np.ones((4, 1), "f4"))
        >>> eng.get_metrics_result()
        {'loss': 1.0}
        >>> eng.reset_metrics()
        >>> eng.get_metrics_result()
        {'loss': 0.0}
        """
        for metric in [self.loss_tracker, *self.metrics]:
            metric.reset_state()

    def get_metrics_result(self) -> dict[str, float]:
        """The loss's and every metric's current value, as Keras' models give.

        >>> make_engine(metrics=["mae"]).get_metrics_result()
        {'loss': 0.0, 'mae': 0.0}
        """
        return {m.name: float(m.result()) for m in [self.loss_tracker, *self.metrics]}

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int = 1,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_data: Any = None,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        steps_per_epoch: int | None = None,
        *,
        checkpoint_dir: str | None = None,
        keep_checkpoints: int = 3,
        checkpoint_every: int | None = None,
        log_dir: str | None = None,
        profile_steps: tuple[int, int] | None = None,
    ) -> History:
        """Trains for ``epochs`` epochs; resumes from ``checkpoint_dir`` if it has one.

        Args:
          x, y, batch_size, sample_weight, class_weight: the data, in Keras' forms
            (:func:`towers.data.as_dataset`): arrays cut into batches of
            ``batch_size``, or a dataset of batches. An epoch is one pass, or
            ``steps_per_epoch`` batches. Checkpoints save the pipeline's position
            (``towers/checkpoint.py``): a resumed run reads each example of the
            epoch once, in an uninterrupted run's order, shuffled data included
            (with a shuffle seed). A pipeline whose position cannot be saved
            (``from_generator``, ``py_function``) gets a warning, and resuming
            skips the batches already trained: its data must come in the same
            order every pass. In a cluster every worker takes the chief's saved
            position, so build the pipeline alike on every worker
            (``towers.shard`` does).
          epochs: the total number of epochs, counting those done before a resume.
          verbose: 1 for a progress bar per epoch, 0 for silence.
          callbacks: Keras callbacks; they see ``model`` (with its ``optimizer``),
            and ``model.stop_training = True`` ends training after the epoch.
          validation_data: ``(x, y[, sample_weight])`` or a dataset, evaluated
            after each epoch; its results join the history as ``val_<name>``.
          steps_per_epoch: batches per epoch; default, the whole data.
          checkpoint_dir: where to save model, optimizer, epoch and step (and the
            epoch's loss and metrics so far, the input pipeline's position) with
            ``tf.train.CheckpointManager``; a directory that holds a checkpoint of
            this model is resumed from. In a cluster the chief alone writes it
            (and progress, and ``log_dir``); every worker restores from it.
          keep_checkpoints: how many checkpoints to keep.
          checkpoint_every: save every this many steps as well as at each epoch's end.
          log_dir: write TensorBoard summaries here (``towers/summaries.py``).
          profile_steps: ``(N, M)``: record a profiler trace of steps N..M (counted
            from 1 as ``steps_done``) into ``log_dir``.

        Returns:
          A ``History``: per epoch, the epoch's loss and metrics (and ``val_`` ones).

        Example:
          >>> eng, x = make_engine(), np.random.default_rng(0).random((20, 3), "f4")
          >>> history = eng.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=3,
          ...                   verbose=0)
          >>> len(history.history["loss"]), eng.steps_done  # 3 batches an epoch
          (3, 9)
          >>> history["loss"][-1] < history["loss"][0]
          True
        """
        dataset = as_dataset(x, y, sample_weight, batch_size, class_weight)
        if not _is_chief(self):
            # In a cluster the chief alone reports and writes; every worker trains.
            verbose, log_dir, profile_steps = 0, None, None
        log = TrainingLog(self, log_dir, profile_steps)  # checks them first
        if not self.model.variables:
            # Build a lazily built model first, so a checkpoint's shapes can be checked.
            self.prepare(*unpack(next(iter(dataset))))
        checkpoint = TrainingCheckpoint(
            self,
            checkpoint_dir,
            keep_checkpoints,
            writes=_is_chief(self),
            epoch_metrics=[self.loss_tracker, *self.metrics],
        )
        batches = dataset.take(steps_per_epoch) if steps_per_epoch else dataset
        iterator = position_iterator(batches, checkpoint_dir)
        start_epoch, start_step, positioned = checkpoint.restore(iterator)
        history = History()
        callback_list = keras.callbacks.CallbackList(
            [*(callbacks or []), history],
            model=self.model,
            epochs=epochs,
            steps=steps_per_epoch,
            verbose=0,
        )
        run = _Run(
            self,
            batches,
            epochs,
            steps_per_epoch,
            verbose,
            callback_list,
            checkpoint,
            checkpoint_every,
            log,
        )
        self.model.stop_training = False
        callback_list.on_train_begin()
        run.preemption = Preemption(self.workers, checkpoint_dir is not None)
        try:
            with run.preemption:
                for epoch in range(start_epoch, epochs):
                    callback_list.on_epoch_begin(epoch)
                    done = start_step if epoch == start_epoch else 0
                    epoch_batches = iter(batches) if iterator is None else iterator
                    if not positioned:
                        for _ in range(done):  # no saved position: skip them
                            next(epoch_batches, None)
                    logs = _train_epoch(run, epoch, done, epoch_batches)
                    # An epoch ends with its last accumulate_steps window applied.
                    self.apply_accumulated()
                    if iterator is not None:
                        # The next epoch's iterator, made now: its shuffle seeds are
                        # drawn here, and the checkpoint below saves them.
                        iterator = iter(batches)
                        checkpoint.follow(iterator)
                    checkpoint.save(epoch + 1, 0)
                    if validation_data is not None:
                        logs.update(_validate(run, validation_data, batch_size))
                    log.after_epoch(logs)
                    callback_list.on_epoch_end(epoch, logs)
                    if self.model.stop_training:
                        break
        finally:
            log.close()
        callback_list.on_train_end()
        return history

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int = 0,
        sample_weight: Any = None,
    ) -> dict[str, float]:
        """The loss and metrics over all of the data, computed by the towers.

        Args:
          x, y, batch_size, sample_weight: the data, as :meth:`fit` takes it.
          verbose: 1 for a progress bar.

        Returns:
          ``{"loss": mean loss over every example, metric name: value}``.

        Example:
          >>> eng = make_engine(metrics=["mae"])
          >>> x, y = np.zeros((10, 3), "float32"), np.full((10, 1), 3.0, "float32")
          >>> eng.evaluate(x, y, batch_size=4)  # bias 0: predicts 0
          {'loss': 9.0, 'mae': 3.0}
        """
        dataset = as_dataset(x, y, sample_weight, batch_size)
        verbose = verbose if _is_chief(self) else 0
        self.reset_metrics()
        bar = Progress(_known_length(dataset)) if verbose else None
        for step, batch in enumerate(dataset, 1):
            self.evaluate_step(*unpack(batch))
            if bar is not None:
                bar.update(step, self.get_metrics_result())
        return self.get_metrics_result()

    def predict(self, x: Any, batch_size: int | None = None, verbose: int = 0) -> Any:
        """The model's outputs on every example of ``x``, in order, as NumPy.

        Each batch is split over the towers, each tower predicts its shard in
        inference mode, and the outputs are concatenated in order.

        Args:
          x: inputs (arrays cut into batches of ``batch_size``), or a dataset
            of batches (of ``x``, or of ``(x, y[, sample_weight])``: the inputs
            are taken).
          batch_size: for array input.
          verbose: 1 for a progress bar.

        Example:
          >>> make_engine().predict(np.zeros((5, 3), "f4"), batch_size=2).shape
          (5, 1)
        """
        if isinstance(x, tf.data.Dataset):
            dataset = as_dataset(x)
        else:
            dataset = tf.data.Dataset.from_tensor_slices(x).batch(
                _check_batch_size(batch_size)
            )
        bar = Progress(_known_length(dataset)) if verbose else None
        outputs = []
        for step, batch in enumerate(dataset, 1):
            outputs.append(self.predict_step(unpack(batch)[0]))
            if bar is not None:
                bar.update(step, {})
        return tf.nest.map_structure(
            lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs
        )


@dataclasses.dataclass
class _Run:
    """What stays the same for every epoch of one fit."""

    engine: Trainer
    dataset: tf.data.Dataset  # one epoch's batches
    epochs: int
    steps_per_epoch: int | None
    verbose: int
    callbacks: keras.callbacks.CallbackList
    checkpoint: TrainingCheckpoint
    checkpoint_every: int | None
    log: TrainingLog
    preemption: Preemption | None = None


def _train_epoch(run: _Run, epoch: int, skip: int, batches: Any) -> dict[str, float]:
    """One epoch from batch ``skip`` on, reading ``batches`` (an iterator that
    stands after the first ``skip``); returns the epoch's loss and metrics."""
    engine = run.engine
    if skip == 0:  # else the checkpoint restored the epoch's metrics so far
        engine.reset_metrics()
    total = run.steps_per_epoch or _known_length(run.dataset)
    bar = None
    if run.verbose:
        print(f"Epoch {epoch + 1}/{run.epochs}")
        bar = Progress(total)
    examples, started = 0, time.perf_counter()
    step = skip
    for batch in batches:
        x, y, sample_weight = unpack(batch)
        size = int(tf.nest.flatten(x)[0].shape[0])
        run.callbacks.on_train_batch_begin(step)
        run.log.before_step()
        run.preemption.before_step()
        step_started = time.perf_counter()
        logs = engine.train_step(x, y, sample_weight)
        # Reading the loss back waits for the step, so the time is the step's.
        logs = {name: float(np.asarray(value)) for name, value in logs.items()}
        run.log.after_step(logs, time.perf_counter() - step_started, size)
        step += 1
        examples += size
        run.callbacks.on_train_batch_end(step - 1, logs)
        # The epoch's last step is saved by the epoch-end checkpoint just after.
        saved = bool(run.checkpoint_every) and step % run.checkpoint_every == 0
        saved = saved and step != total
        if saved:
            run.checkpoint.save(epoch, step)
        if run.preemption.stop_now():
            if not saved:
                run.checkpoint.save(epoch, step)
            where = f"epoch {epoch + 1} step {step}"
            run.preemption.exit(where, run.checkpoint.directory)
        if bar is not None:
            rate = examples / max(time.perf_counter() - started, 1e-9)
            bar.update(step, {**engine.get_metrics_result(), "examples/s": rate})
    if step == skip and skip == 0:
        raise ValueError(
            f"epoch {epoch + 1} got no batches: the dataset is empty or exhausted "
            "(with steps_per_epoch, repeat() the dataset)"
        )
    if bar is not None and total is None:
        bar.update(step, engine.get_metrics_result(), done=True)
    return engine.get_metrics_result()


def _validate(run: _Run, data: Any, batch_size: int | None) -> dict[str, float]:
    """The validation results, as ``val_<name>``; printed under the bar."""
    if isinstance(data, tf.data.Dataset):
        results = run.engine.evaluate(data)
    else:
        x, y, sample_weight = (*data, None)[:3]
        results = run.engine.evaluate(x, y, batch_size, 0, sample_weight)
    if run.verbose:
        print(
            "  "
            + " - ".join(Progress.format(f"val_{k}", v) for k, v in results.items())
        )
    return {f"val_{name}": value for name, value in results.items()}


def _is_chief(engine: Trainer) -> bool:
    return engine.cluster is None or engine.cluster.is_chief


def _check_batch_size(batch_size: Any) -> int:
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(
            "array input needs a positive batch_size; received "
            f"batch_size={batch_size!r}"
        )
    return batch_size


def _known_length(dataset: tf.data.Dataset) -> int | None:
    length = int(dataset.cardinality())
    return length if length >= 0 else None

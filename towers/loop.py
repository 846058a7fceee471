"""fit and evaluate: feed global batches from tf.data to a Towers engine.

What Keras' ``fit`` gives, on top of the engine's placement and exactness: a progress
bar per epoch, a history, Keras callbacks, validation, and checkpoints that resume
where a killed run stopped (see ``checkpoint.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.checkpoint import TrainingCheckpoint
from towers.data import as_dataset
from towers.summaries import TrainingLog


class Trainer(abc.ABC):
    """``fit`` and ``evaluate`` on top of an engine's steps, as Keras' ``Trainer``
    gives them to a backend's ``train_step``. ``towers.Towers`` is one.

    Besides the methods below, ``fit`` reads ``model`` (callbacks see it),
    ``loss_tracker`` and ``metrics`` (Keras metrics), ``cluster`` (None, or a
    ``towers.Cluster``: its chief alone reports and writes), and what checkpoints
    and logs need: ``variable_device``, ``optimizer``, ``steps_done``,
    ``training_state()``, ``after_restore()`` (``towers/checkpoint.py``,
    ``towers/summaries.py``).
    """

    @abc.abstractmethod
    def prepare(self, x: Any, y: Any = None, sample_weight: Any = None) -> tuple:
        """Checks a batch and builds a lazily built model from it."""

    @abc.abstractmethod
    def train_step(self, x: Any, y: Any) -> dict[str, Any]:
        """One training step; returns the batch's loss and the metrics."""

    @abc.abstractmethod
    def evaluate_step(self, x: Any, y: Any) -> dict[str, Any]:
        """Updates the loss and metrics with one batch."""

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
        {'loss': 0.0, 'mean_absolute_error': 0.0}
        """
        return {m.name: float(m.result()) for m in [self.loss_tracker, *self.metrics]}

    def fit(
        self,
        data: Any,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        validation_data: Any = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        verbose: int = 1,
        checkpoint_dir: str | None = None,
        keep_checkpoints: int = 3,
        checkpoint_every: int | None = None,
        batch_size: int | None = None,
        log_dir: str | None = None,
        profile_steps: tuple[int, int] | None = None,
    ) -> dict[str, list[float]]:
        """Trains for ``epochs`` epochs; resumes from ``checkpoint_dir`` if it has one.

        Args:
          data: see :func:`towers.data.as_dataset`. An epoch is one pass, or
            ``steps_per_epoch`` batches. Resuming mid-epoch skips the batches
            already trained, so the dataset must give the same batches in the
            same order each time it is iterated (shuffle with a fixed seed and
            ``reshuffle_each_iteration=False``).
          epochs: the total number of epochs, counting those done before a resume.
          steps_per_epoch: batches per epoch; default, the whole dataset.
          validation_data: evaluated after each epoch; its results join the history
            as ``val_<name>``.
          callbacks: Keras callbacks (``on_epoch_end``, ``on_train_batch_end``, ...);
            setting ``model.stop_training = True`` ends training after the epoch.
          verbose: 1 for a progress bar per epoch, 0 for silence.
          checkpoint_dir: where to save model, optimizer, epoch and step with
            ``tf.train.CheckpointManager``; a directory that holds a checkpoint of this
            model is resumed from. In a cluster the chief alone writes it and every
            worker restores from it (a directory they all see), as it also alone
            shows progress and writes ``log_dir``.
          keep_checkpoints: how many checkpoints to keep.
          checkpoint_every: save every this many steps as well as at each epoch's end.
          batch_size: for array input.
          log_dir: write TensorBoard summaries here (see ``towers/summaries.py``):
            per step loss, metrics, step time, examples/s and learning rate; per epoch
            the epoch's and validation results.
          profile_steps: ``(N, M)``: record a profiler trace of steps N..M (counted
            from 1 as ``steps_done``) into ``log_dir``.

        Returns:
          The history: per epoch, the epoch's loss and metrics (and ``val_`` ones).

        Example:
          >>> eng, x = make_engine(), np.random.default_rng(0).random((20, 3), "f4")
          >>> history = eng.fit((x, x.sum(1, keepdims=True)), batch_size=8, epochs=3,
          ...                   verbose=0)
          >>> len(history["loss"]), eng.steps_done  # 3 batches an epoch
          (3, 9)
          >>> history["loss"][-1] < history["loss"][0]
          True
        """
        dataset = as_dataset(data, batch_size)
        if not _is_chief(self):
            # In a cluster the chief alone reports and writes; every worker trains.
            verbose, log_dir, profile_steps = 0, None, None
        log = TrainingLog(self, log_dir, profile_steps)  # checks them first
        if not self.model.variables:
            # Build a lazily built model first, so a checkpoint's shapes can be checked.
            self.prepare(*next(iter(dataset)))
        checkpoint = TrainingCheckpoint(
            self, checkpoint_dir, keep_checkpoints, writes=_is_chief(self)
        )
        start_epoch, start_step = checkpoint.restore()
        run = _Run(
            self,
            dataset,
            epochs,
            steps_per_epoch,
            verbose,
            keras.callbacks.CallbackList(
                callbacks,
                model=self.model,
                epochs=epochs,
                steps=steps_per_epoch,
                verbose=0,
            ),
            checkpoint,
            checkpoint_every,
            log,
        )
        self.model.stop_training = False
        run.callbacks.on_train_begin()
        history: dict[str, list[float]] = {}
        try:
            for epoch in range(start_epoch, epochs):
                run.callbacks.on_epoch_begin(epoch)
                skip = start_step if epoch == start_epoch else 0
                logs = _train_epoch(run, epoch, skip)
                # An epoch ends with its last accumulate_steps window applied.
                self.apply_accumulated()
                checkpoint.save(epoch + 1, 0)
                if validation_data is not None:
                    logs.update(_validate(run, validation_data, batch_size))
                for name, value in logs.items():
                    history.setdefault(name, []).append(value)
                run.log.after_epoch(logs)
                run.callbacks.on_epoch_end(epoch, logs)
                if self.model.stop_training:
                    break
        finally:
            run.log.close()
        run.callbacks.on_train_end(history)
        return history

    def evaluate(
        self, data: Any, batch_size: int | None = None, verbose: int = 0
    ) -> dict[str, float]:
        """The loss and metrics over all of ``data``, computed by the towers.

        Args:
          data: see :func:`towers.data.as_dataset`.
          batch_size: for array input.
          verbose: 1 for a progress bar.

        Returns:
          ``{"loss": mean loss over every example, metric name: value}``.

        Example:
          >>> eng = make_engine(metrics=["mae"])
          >>> x, y = np.zeros((10, 3), "float32"), np.full((10, 1), 3.0, "float32")
          >>> eng.evaluate((x, y), batch_size=4, verbose=0)  # bias 0: predicts 0
          {'loss': 9.0, 'mean_absolute_error': 3.0}
        """
        dataset = as_dataset(data, batch_size)
        verbose = verbose if _is_chief(self) else 0
        self.reset_metrics()
        bar = keras.utils.Progbar(_known_length(dataset)) if verbose else None
        for step, (x, y) in enumerate(dataset, 1):
            self.evaluate_step(x, y)
            if bar is not None:
                bar.update(step)
        return self.get_metrics_result()


@dataclasses.dataclass
class _Run:
    """What stays the same for every epoch of one fit."""

    engine: Trainer
    dataset: tf.data.Dataset
    epochs: int
    steps_per_epoch: int | None
    verbose: int
    callbacks: keras.callbacks.CallbackList
    checkpoint: TrainingCheckpoint
    checkpoint_every: int | None
    log: TrainingLog


def _train_epoch(run: _Run, epoch: int, skip: int) -> dict[str, float]:
    """One epoch from batch ``skip`` on; returns the epoch's loss and metrics."""
    engine, steps_per_epoch = run.engine, run.steps_per_epoch
    engine.reset_metrics()
    batches = run.dataset.take(steps_per_epoch) if steps_per_epoch else run.dataset
    total = steps_per_epoch or _known_length(run.dataset)
    bar = _progress_bar(epoch, run.epochs, total, engine, run.verbose)
    examples, started = 0, time.perf_counter()
    step = skip
    for x, y in batches.skip(skip):
        batch = int(tf.nest.flatten(x)[0].shape[0])
        run.log.before_step()
        step_started = time.perf_counter()
        logs = engine.train_step(x, y)
        # Reading the loss back waits for the step, so the time is the step's.
        logs = {name: float(np.asarray(value)) for name, value in logs.items()}
        run.log.after_step(logs, time.perf_counter() - step_started, batch)
        step += 1
        examples += batch
        run.callbacks.on_train_batch_end(step - 1, logs)
        if run.checkpoint_every and step % run.checkpoint_every == 0:
            run.checkpoint.save(epoch, step)
        if bar is not None:
            rate = examples / max(time.perf_counter() - started, 1e-9)
            bar.update(step, _bar_values(engine, rate))
    if step == skip and skip == 0:
        raise ValueError(
            f"epoch {epoch + 1} got no batches: the dataset is empty or exhausted "
            "(with steps_per_epoch, repeat() the dataset)"
        )
    return engine.get_metrics_result()


def _validate(run: _Run, data: Any, batch_size: int | None) -> dict[str, float]:
    """The validation results, as ``val_<name>``; printed under the bar."""
    results = run.engine.evaluate(data, batch_size=batch_size)
    if run.verbose:
        print("  " + "  ".join(f"val_{k}: {v:.4f}" for k, v in results.items()))
    return {f"val_{name}": value for name, value in results.items()}


def _is_chief(engine: Trainer) -> bool:
    return engine.cluster is None or engine.cluster.is_chief


def _bar_values(engine: Trainer, rate: float) -> list[tuple[str, float]]:
    values = list(engine.get_metrics_result().items())
    return [*values, ("examples/s", round(rate))]


def _progress_bar(epoch, epochs, total, engine, verbose):
    if not verbose:
        return None
    print(f"Epoch {epoch + 1}/{epochs}")
    names = [*engine.get_metrics_result(), "examples/s"]
    return keras.utils.Progbar(total, stateful_metrics=names)


def _known_length(dataset: tf.data.Dataset) -> int | None:
    length = int(dataset.cardinality())
    return length if length >= 0 else None

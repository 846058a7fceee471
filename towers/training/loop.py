"""fit, evaluate and predict: feed global batches from tf.data to an engine.

What Keras' ``fit`` gives, on top of the engine's placement and exactness: Keras'
data forms (arrays with ``batch_size``, datasets of ``x``, ``(x, y)`` or ``(x, y,
sample_weight)``, ``sample_weight`` and ``class_weight``), a progress bar per
epoch, a ``History``, Keras callbacks, validation, and checkpoints that resume
where a killed run stopped (see ``checkpoint.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.training.checkpoint import TrainingCheckpoint, position_iterator
from towers.training.data import as_dataset, check_batch_size, split_validation, unpack
from towers.training.epoch import (
    Run,
    check_fit_arguments,
    check_positive,
    known_length,
    should_validate,
    shuffle_seed,
    train_epoch,
    validate,
    validation_batches,
)
from towers.training.preemption import Preemption
from towers.training.progress import History, Progress
from towers.training.summaries import TrainingLog


class Trainer(abc.ABC):
    """``fit``, ``evaluate`` and ``predict`` on top of an engine's steps, as
    Keras' ``Trainer`` gives them to a backend's ``train_step``. ``towers.Towers``
    is one.

    Besides the methods below, ``fit`` reads ``model`` (callbacks see it),
    ``loss_tracker`` and ``metrics`` (Keras metrics), ``cluster`` (None, or a
    ``towers.Cluster``: its chief alone reports and writes), ``workers`` (None,
    or its link to them: a preemption notice rides in its sums), and what checkpoints
    and logs need: ``variable_device``, ``optimizer``, ``steps_done``,
    ``training_state()``, ``after_restore()`` (``towers/training/checkpoint.py``,
    ``towers/training/summaries.py``).
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
        verbose: int | str = "auto",
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool | int = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
        *,
        checkpoint_dir: str | None = None,
        keep_checkpoints: int = 3,
        checkpoint_every: int | None = None,
        log_dir: str | None = None,
        profile_steps: tuple[int, int] | None = None,
    ) -> History:
        """Trains for ``epochs`` epochs; resumes from ``checkpoint_dir`` if it has one.

        The arguments before ``*`` are Keras' ``fit``'s, in its order, with its
        defaults.

        Args:
          x, y, batch_size, sample_weight, class_weight: the data, in Keras' forms
            (:func:`towers.training.data.as_dataset`): arrays cut into batches of
            ``batch_size`` (default 32), or a dataset of batches. An epoch is
            one pass, or ``steps_per_epoch`` batches. Checkpoints save the
            pipeline's position (``towers/training/checkpoint.py``): a resumed run reads
            each example of the epoch once, in an uninterrupted run's order,
            shuffled data included
            (with a shuffle seed). A pipeline whose position cannot be saved
            (``from_generator``, ``py_function``) gets a warning, and resuming
            skips the batches already trained: its data must come in the same
            order every pass. In a cluster every worker takes the chief's saved
            position, so build the pipeline alike on every worker
            (``towers.shard`` does).
          epochs: the total number of epochs, counting those done before a resume.
          verbose: 1 (or ``"auto"``) for a progress bar per epoch, 2 for one line
            per epoch (for logs), 0 for silence.
          callbacks: Keras callbacks; they see ``model`` (with its ``optimizer``),
            and ``model.stop_training = True`` ends training after the epoch.
          validation_split: the fraction of array data (its last examples, as
            Keras takes them) held out and evaluated after each epoch, when
            there is no ``validation_data``.
          validation_data: ``(x, y[, sample_weight])`` or a dataset, evaluated
            after each epoch; its results join the history as ``val_<name>``.
          shuffle: for array data, a new order of the examples every epoch
            (True, as Keras' default; an int: with that seed), or the arrays'
            order (False). The seed is drawn from NumPy's generator
            (``keras.utils.set_random_seed`` fixes it), saved with each
            checkpoint so a resumed run comes in the uninterrupted run's orders,
            and in a cluster taken from the chief. A dataset is not shuffled:
            shuffle it in the pipeline.
          initial_epoch: the epoch to start at (0-based) when no checkpoint
            says where to resume.
          steps_per_epoch: batches per epoch; default, the whole data.
          validation_steps: how many validation batches to evaluate; default all.
          validation_batch_size: the batch size of array validation data;
            default ``batch_size``.
          validation_freq: validate every this many epochs, or after the epochs
            (counted from 1) in a list.
          checkpoint_dir: where to save model, optimizer, epoch and step (and the
            epoch's loss and metrics so far, the input pipeline's position) with
            ``tf.train.CheckpointManager``; a directory that holds a checkpoint of
            this model is resumed from. In a cluster the chief alone writes it
            (and progress, and ``log_dir``); every worker restores from it.
          keep_checkpoints: how many checkpoints to keep.
          checkpoint_every: save every this many steps as well as at each epoch's end.
          log_dir: write TensorBoard summaries here (``towers/training/summaries.py``).
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
        verbose = check_fit_arguments(
            verbose, validation_split, initial_epoch, validation_freq, shuffle
        )
        for name, value in (
            ("validation_steps", validation_steps),
            ("validation_batch_size", validation_batch_size),
        ):
            if value is not None:
                check_positive(name, value)
        if validation_split and validation_data is None:
            x, y, sample_weight, validation_data = split_validation(
                x, y, sample_weight, validation_split
            )
        dataset = as_dataset(x, y, sample_weight, batch_size, class_weight)
        validation = None
        if validation_data is not None:
            validation = validation_batches(
                validation_data, validation_batch_size or batch_size, validation_steps
            )
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
        batches_of = self._epoch_batches(
            dataset, (x, y, sample_weight, batch_size, class_weight), shuffle,
            steps_per_epoch, checkpoint,
        )  # fmt: skip
        first = checkpoint.saved("epoch")
        first = initial_epoch if first is None else first
        iterator = position_iterator(batches_of(first), checkpoint_dir)
        start_epoch, start_step, positioned = checkpoint.restore(iterator)
        if (start_epoch, start_step) == (0, 0):
            start_epoch = initial_epoch
        history = History()
        callback_list = keras.callbacks.CallbackList(
            [*(callbacks or []), history],
            model=self.model,
            epochs=epochs,
            steps=steps_per_epoch,
            verbose=0,
        )
        run = Run(
            self,
            batches_of(first),
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
                    if iterator is None:
                        epoch_batches = iter(batches_of(epoch))
                    else:
                        epoch_batches = iterator
                    if not positioned:
                        for _ in range(done):  # no saved position: skip them
                            next(epoch_batches, None)
                    logs = train_epoch(run, epoch, done, epoch_batches)
                    # An epoch ends with its last accumulate_steps window applied.
                    self.apply_accumulated()
                    if iterator is not None:
                        # The next epoch's iterator, made now: the checkpoint below
                        # saves it (its position, and a pipeline's shuffle seeds).
                        iterator = iter(batches_of(epoch + 1))
                        checkpoint.follow(iterator)
                    checkpoint.save(epoch + 1, 0)
                    if validation is not None and should_validate(
                        epoch, validation_freq
                    ):
                        logs.update(validate(run, validation))
                    if verbose == 2:  # one line per epoch, validation included
                        print(Progress.summary(*run.last_epoch, logs), flush=True)
                    log.after_epoch(logs)
                    callback_list.on_epoch_end(epoch, logs)
                    if self.model.stop_training:
                        break
        finally:
            log.close()
        callback_list.on_train_end()
        return history

    def _epoch_batches(self, dataset, arrays, shuffle, steps, checkpoint):
        """``epoch -> that epoch's batches``: ``dataset`` every epoch, or for
        arrays fit shuffles, each epoch's own order (``shuffle_seed``)."""
        if shuffle is False or isinstance(arrays[0], tf.data.Dataset):
            fixed = dataset.take(steps) if steps else dataset
            return lambda epoch: fixed
        seed = shuffle_seed(shuffle, checkpoint, self.workers)
        # Converted once: every epoch's dataset gathers from the same tensors.
        x, y, sample_weight, batch_size, class_weight = arrays
        x, y, sample_weight = [
            None if a is None else tf.nest.map_structure(tf.convert_to_tensor, a)
            for a in (x, y, sample_weight)
        ]

        def batches_of(epoch: int) -> tf.data.Dataset:
            data = as_dataset(
                x, y, sample_weight, batch_size, class_weight, (seed, epoch)
            )
            return data.take(steps) if steps else data

        return batches_of

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
          x, y, batch_size, sample_weight: the data, as :meth:`fit` takes it
            (arrays in batches of ``batch_size``, default 32).
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
        bar = Progress(known_length(dataset)) if verbose else None
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
          batch_size: for array input (default 32, as Keras').
          verbose: 1 for a progress bar.

        Example:
          >>> make_engine().predict(np.zeros((5, 3), "f4"), batch_size=2).shape
          (5, 1)
        """
        if isinstance(x, tf.data.Dataset):
            dataset = as_dataset(x)
        else:
            dataset = tf.data.Dataset.from_tensor_slices(x).batch(
                check_batch_size(batch_size)
            )
        bar = Progress(known_length(dataset)) if verbose else None
        outputs = []
        for step, batch in enumerate(dataset, 1):
            outputs.append(self.predict_step(unpack(batch)[0]))
            if bar is not None:
                bar.update(step, {})
        return tf.nest.map_structure(
            lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs
        )


def _is_chief(engine: Trainer) -> bool:
    return engine.cluster is None or engine.cluster.is_chief

"""fit, evaluate and predict: Keras' own loops over an engine's steps.

What Keras' ``fit``, ``evaluate`` and ``predict`` give, on top of the engine's
placement and exactness: every input form Keras takes, through Keras' own data
adapters (``inputs.py``); steps and epochs as Keras' ``EpochIterator`` counts
them (``epochs.py``); Keras' callbacks with every hook, its progress bar, its
``History`` and its return values; and checkpoints that resume where a killed
run stopped (``checkpoint.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from towers._keras import leaf_metrics, metrics_in_order, pythonify_logs
from towers._keras.inputs import initial_epoch as restored_epoch
from towers.training.arguments import (
    check_class_weight,
    check_fit_arguments,
    check_fit_extras,
    check_inputs,
    check_positive,
    check_verbose,
    should_validate,
    shuffle_seed,
)
from towers.training.checkpoint import TrainingCheckpoint
from towers.training.epochs import Epochs, limited
from towers.training.fits import check_form, check_validation, named_misfits
from towers.training.inputs import source_of, split_validation, unpack
from towers.training.model_metrics import ModelMetrics
from towers.training.overrides import through_override
from towers.training.preemption import Preemption
from towers.training.progress import History
from towers.training.recompile import follow_compile
from towers.training.run import (
    FitRun,
    evaluate_loop,
    fit_epoch,
    make_callbacks,
    predict_loop,
    resume,
    say_resumed,
)
from towers.training.summaries import TrainingLog


class Trainer(ModelMetrics, abc.ABC):
    """``fit``, ``evaluate`` and ``predict`` on top of an engine's steps, as
    Keras' ``Trainer`` gives them to a backend's ``train_step``. ``towers.Towers``
    is one.

    Besides the methods below, ``fit`` reads ``model`` (callbacks see it; its
    own metrics are reported), ``loss_tracker``, ``cluster`` (None, or a
    ``towers.Cluster``: its chief alone reports and writes), ``workers`` (None,
    or its link to them: a preemption notice rides in its sums), ``placement``
    (its ``finalize()`` ends a fit, as Keras'), and what checkpoints
    and logs need: ``variable_device``, ``optimizer``, ``steps_done``,
    ``training_state()``, ``after_restore()`` (``towers/training/checkpoint.py``,
    ``towers/training/summaries.py``); each call first takes up a compile of
    the model since the engine was made (``towers/training/recompile.py``).
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

    @through_override
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
        defaults, read as Keras' own fit reads them.

        Args:
          x, y, batch_size, sample_weight, class_weight: the data, in every form
            Keras' fit takes, through Keras' own data adapters
            (:func:`towers.training.inputs.source_of`): arrays, tensors, pandas
            and nests of them (cut into batches of ``batch_size``, default 32),
            a ``tf.data.Dataset`` of batches (finite or repeated), a Python
            generator of batches, a ``keras.utils.PyDataset`` (its workers
            honoured). Checkpoints save the position in the data: a resumed
            run reads each batch of the epoch once, in an uninterrupted run's
            order, shuffled data included (arrays and tf.data: the pipeline's
            own position; a ``PyDataset``: its batch index). A generator, or a
            pipeline whose position cannot be saved (``py_function``), gets a
            warning, and resuming reads the batches already trained again and
            drops them: its data must come in the same order every pass. In a
            cluster every worker takes the chief's saved position, so build
            the pipeline alike on every worker (``towers.shard`` does).
          epochs: the total number of epochs, counting those done before a resume.
          verbose: ``"auto"`` or 1: Keras' progress bar (updated in place on a
            terminal, one line per epoch in a file); 2: one line per epoch; 0:
            silence.
          callbacks: Keras callbacks, with every hook Keras' fit calls (the
            ``on_test_*`` ones for validation); they see ``model`` (with its
            ``optimizer``). ``model.stop_training = True`` ends training after
            the batch. ``keras.callbacks.BackupAndRestore`` resumes at the
            epoch it saved, as in Keras' fit; it is refused with
            ``checkpoint_dir``, which does its job and more (the position
            inside the epoch): use one of the two.
          validation_split: the fraction of array data (its last examples, as
            Keras takes them) held out and evaluated after each epoch, when
            there is no ``validation_data``.
          validation_data: ``(x, y[, sample_weight])``, or any input form above;
            evaluated after each epoch, its results logged as ``val_<name>``.
          shuffle: for arrays and a ``PyDataset``, a new order of the examples
            (of the batches) every pass over the data (True, as Keras'
            default; an int: with that seed), or their order (False). The seed
            is drawn from NumPy's generator (``keras.utils.set_random_seed``
            fixes it), saved with each checkpoint so a resumed run comes in the
            uninterrupted run's orders, and in a cluster taken from the chief.
            A dataset or generator comes as it is (Keras warns of
            ``shuffle=True`` with a dataset, as here).
          initial_epoch: the epoch to start at (0-based) when no checkpoint
            says where to resume.
          steps_per_epoch: batches per epoch, as Keras counts them: the next ones
            of a pass that runs on across epochs. Default: one pass an epoch.
          validation_steps: how many validation batches to evaluate; default all.
          validation_batch_size: the batch size of array validation data;
            default ``batch_size``.
          validation_freq: validate every this many epochs, or after the epochs
            (counted from 1) in a list.
          checkpoint_dir: where to save model, optimizer, epoch and step (and the
            epoch's loss and metrics so far, the position in the data) with
            ``tf.train.CheckpointManager``; a directory that holds a checkpoint of
            this model is resumed from. In a cluster the chief alone writes it
            (and progress, and ``log_dir``); every worker restores from it.
          keep_checkpoints: how many checkpoints to keep.
          checkpoint_every: save every this many steps as well as at each epoch's end.
          log_dir: write TensorBoard summaries here (``towers/training/summaries.py``).
          profile_steps: ``(N, M)``: record a profiler trace of steps N..M (counted
            from 1 as ``steps_done``) into ``log_dir``.

        Returns:
          A ``History``: per epoch, the epoch's loss and metrics (and ``val_``
          ones); its ``params`` are Keras' (``verbose``, ``epochs``, ``steps``).

        Example:
          >>> eng, x = make_engine(), np.random.default_rng(0).random((20, 3), "f4")
          >>> history = eng.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=3,
          ...                   verbose=0)
          >>> len(history.history["loss"]), eng.steps_done  # 3 batches an epoch
          (3, 9)
          >>> history["loss"][-1] < history["loss"][0]
          True
        """
        follow_compile(self)  # the model's compile as it is now
        self.require_compiled("fit")
        check_inputs(x)
        check_fit_arguments(
            verbose, validation_split, initial_epoch, validation_freq, shuffle, epochs
        )
        callbacks = list(callbacks or [])
        check_fit_extras(
            {
                "steps_per_epoch": steps_per_epoch,
                "validation_steps": validation_steps,
                "validation_batch_size": validation_batch_size,
            },
            callbacks,
            checkpoint_dir,
        )
        check_class_weight(class_weight)
        # keras.config's limits, as Keras' fit and its EpochIterator read them.
        epochs = limited("epochs", epochs)
        steps_per_epoch = limited("steps_per_epoch", steps_per_epoch)
        validation_steps = limited("steps_per_epoch", validation_steps)
        if validation_split and validation_data is None:
            x, y, sample_weight, validation_data = split_validation(
                x, y, sample_weight, validation_split
            )
        source = source_of(
            x, y, sample_weight, batch_size, steps_per_epoch, shuffle is not False,
            class_weight,
        )  # fmt: skip
        validation = None
        if validation_data is not None:
            check_form(validation_data, "validation_data")
            val_x, val_y, val_sample_weight = unpack(validation_data)
            check_inputs(val_x, "validation_data's x")
            validation = source_of(
                val_x, val_y, val_sample_weight, validation_batch_size or batch_size,
                validation_steps, argument="validation_data's ",
            )  # fmt: skip
        if not _is_chief(self):
            # In a cluster the chief alone reports and writes; every worker trains.
            verbose, log_dir, profile_steps = 0, None, None
        log = TrainingLog(self, log_dir, profile_steps)  # checks them first
        if not self.step.started:
            # Build a lazily built model first (and the step's own state, a
            # model with variables made before it is built too), so a
            # checkpoint's shapes can be checked.
            self.prepare(*unpack(source.sample()), kind="train")
        # The compiled metrics too, which a checkpoint saves, from the
        # batches' shapes (nothing read), as Keras' fit builds them.
        with named_misfits(self.model, unpack(source.spec()), (x, y, sample_weight)):
            self.build_metrics(*unpack(source.spec()))
        if validation is not None:  # before any update, by shapes
            check_validation(self.model, source, validation, validation_data)
        checkpoint = TrainingCheckpoint(
            self,
            checkpoint_dir,
            keep_checkpoints,
            writes=_is_chief(self),
            epoch_metrics=leaf_metrics(self.model),
        )
        if source.seeded:
            source.seed = shuffle_seed(shuffle, checkpoint, self.workers)
        batches = Epochs(source, steps_per_epoch)
        start_epoch, start_step = resume(self, checkpoint, batches, initial_epoch)
        say_resumed(checkpoint, start_epoch, start_step, epochs, verbose)
        history = History()
        steps = batches.steps
        callback_list = make_callbacks(
            self, [*callbacks, history], verbose, epochs, steps
        )
        run = FitRun(
            callback_list, checkpoint, checkpoint_every, log, batches,
            Preemption(self.workers, checkpoint_dir is not None),
        )  # fmt: skip
        self.model.stop_training = False
        callback_list.on_train_begin()
        restored = restored_epoch(self.model)
        if restored:  # keras.callbacks.BackupAndRestore restored the model
            self.after_restore()
            start_epoch, start_step = restored, 0
        logs = None
        try:
            with run.preemption:
                for epoch in range(start_epoch, epochs):
                    first = start_step if epoch == start_epoch else 0
                    logs = fit_epoch(self, run, epoch, first)
                    if validation is not None and should_validate(
                        epoch, validation_freq
                    ):
                        results = evaluate_loop(
                            self, Epochs(validation, validation_steps), callback_list
                        )
                        logs.update({f"val_{k}": v for k, v in results.items()})
                    log.after_epoch(pythonify_logs(logs))
                    callback_list.on_epoch_end(epoch, logs)
                    if self.model.stop_training:
                        break
        finally:
            log.close()
            restored_epoch(self.model, forget=True)
        if epochs > 0:  # as Keras' fit ends: an optimizer's EMA into the weights
            self.placement.finalize()
        if logs is not None:  # as Keras' fit: no epoch run, no on_train_end
            callback_list.on_train_end(logs)
        return history

    @through_override
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """The loss and metrics over the data, computed by the towers, as
        Keras' ``evaluate`` (its arguments, order, defaults and return).

        Args:
          x, y, batch_size, sample_weight: the data, in any form :meth:`fit`
            takes (arrays in batches of ``batch_size``, default 32).
          verbose: ``"auto"`` or 1: Keras' progress bar; 0: silence.
          steps: evaluate this many batches; default, all of the data.
          callbacks: Keras callbacks; their ``on_test_*`` hooks are called,
            and ``model.stop_evaluating = True`` ends the evaluation.
          return_dict: return ``{name: value}`` rather than a list.

        Returns:
          As Keras: the loss alone for a model without metrics, else ``[loss,
          metric, ...]`` in the model's metric order; ``{"loss": ..., name:
          ...}`` with ``return_dict=True``.

        Example:
          >>> eng = make_engine(metrics=["mae"])
          >>> x, y = np.zeros((10, 3), "float32"), np.full((10, 1), 3.0, "float32")
          >>> eng.evaluate(x, y, batch_size=4, verbose=0)  # bias 0: predicts 0
          [9.0, 3.0]
          >>> eng.evaluate(x, y, verbose=0, return_dict=True)
          {'loss': 9.0, 'mae': 3.0}
        """
        follow_compile(self)  # the model's compile as it is now
        self.require_compiled("evaluate")
        verbose = check_verbose(verbose) if _is_chief(self) else 0
        if steps is not None:
            check_positive("steps", steps)
        steps = limited("steps_per_epoch", steps)  # keras.config's, as Keras'
        check_inputs(x)
        source = source_of(x, y, sample_weight, batch_size, steps)
        if not self.model.variables:
            self.prepare(*unpack(source.sample()), kind="evaluate")
        with named_misfits(self.model, unpack(source.spec()), (x, y, sample_weight)):
            self.build_metrics(*unpack(source.spec()), training=False)
        batches = Epochs(source, steps)
        logs = evaluate_loop(
            self, batches, make_callbacks(self, callbacks, verbose, 1, batches.steps)
        )
        if return_dict:
            return logs
        return metrics_in_order(self.model, logs)

    @through_override
    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
    ) -> Any:
        """The model's outputs on the examples of ``x``, in order, as NumPy, as
        Keras' ``predict`` (its arguments, order and defaults).

        Each batch is split over the towers, each tower predicts its shard in
        inference mode, and the outputs are concatenated in order.

        Args:
          x: inputs, in any form :meth:`fit` takes (with targets, they are
            left out).
          batch_size: for array input (default 32, as Keras').
          verbose: ``"auto"`` or 1: Keras' progress bar; 0: silence.
          steps: predict this many batches; default, all of the data.
          callbacks: Keras callbacks; their ``on_predict_*`` hooks are called
            (``on_predict_batch_end`` with ``{"outputs": ...}``), and
            ``model.stop_predicting = True`` ends the prediction.

        Example:
          >>> make_engine().predict(np.zeros((5, 3), "f4"), batch_size=2,
          ...                       verbose=0).shape
          (5, 1)
        """
        follow_compile(self)  # the model's compile as it is now
        verbose = check_verbose(verbose) if _is_chief(self) else 0
        if steps is not None:
            check_positive("steps", steps)
        steps = limited("steps_per_epoch", steps)  # keras.config's, as Keras'
        check_inputs(x)
        batches = Epochs(source_of(x, None, None, batch_size, steps), steps)
        callbacks = make_callbacks(self, callbacks, verbose, 1, batches.steps)
        return predict_loop(self, batches, callbacks)


def _is_chief(engine: Trainer) -> bool:
    return engine.cluster is None or engine.cluster.is_chief

"""fit and evaluate: feed global batches from tf.data to a Towers engine.

What Keras' ``fit`` gives, on top of the engine's placement and exactness: a progress
bar per epoch, a history, Keras callbacks, validation, and checkpoints that resume
where a killed run stopped (see ``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from towers.checkpoint import TrainingCheckpoint
from towers.summaries import TrainingLog

if TYPE_CHECKING:
    from towers.engine import Towers


def as_dataset(data: Any, batch_size: int | None = None) -> tf.data.Dataset:
    """A dataset of ``(x, y)`` global batches, prefetched.

    Args:
      data: a ``tf.data.Dataset`` whose elements are ``(x, y)`` batches, or a tuple
        ``(x, y)`` of NumPy arrays / tensors (then ``batch_size`` is required).
      batch_size: global batch size for array input. The last batch may be smaller:
        it is trained exactly, not dropped or padded.

    Raises:
      ValueError: elements are not ``(x, y)``, array input without ``batch_size``, or
        a dataset with no elements.
    """
    if isinstance(data, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError(
                f"batch_size is for array input; received batch_size={batch_size} "
                "with a tf.data.Dataset, which is batched already"
            )
        dataset = data
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                "array input (x, y) needs a positive batch_size; received "
                f"batch_size={batch_size!r}"
            )
        dataset = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(batch_size)
    else:
        raise ValueError(
            "data must be a tf.data.Dataset of (x, y) batches or a tuple (x, y) of "
            f"arrays; received {type(data).__name__}"
        )
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ValueError(
            f"dataset elements must be (x, y) pairs; received elements of {spec}"
        )
    if dataset.cardinality() == 0:
        raise ValueError("the dataset is empty; received a dataset with 0 batches")
    # Input is prepared on the host while the towers compute the previous step.
    return dataset.prefetch(tf.data.AUTOTUNE)


def fit(
    engine: Towers,
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
      engine: the Towers engine.
      data: see :func:`as_dataset`. An epoch is one pass, or ``steps_per_epoch``
        batches. Resuming mid-epoch skips the batches already trained, so the
        dataset must give the same batches in the same order each time it is
        iterated (shuffle with a fixed seed and ``reshuffle_each_iteration=False``).
      epochs: the total number of epochs, counting those done before a resume.
      steps_per_epoch: batches per epoch; default, the whole dataset.
      validation_data: evaluated after each epoch; its results join the history
        as ``val_<name>``.
      callbacks: Keras callbacks (``on_epoch_end``, ``on_train_batch_end``, ...);
        setting ``engine.model.stop_training = True`` ends training after the epoch.
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
        from 1 as ``engine.steps_done``) into ``log_dir``.

    Returns:
      The history: per epoch, the epoch's loss and metrics (and ``val_`` ones).
    """
    dataset = as_dataset(data, batch_size)
    if not _is_chief(engine):
        # In a cluster the chief alone reports and writes; every worker trains.
        verbose, log_dir, profile_steps = 0, None, None
    log = TrainingLog(engine, log_dir, profile_steps)
    if not engine.model.variables:
        # Build a lazily built model first, so a checkpoint's shapes can be checked.
        engine._prepare(*next(iter(dataset)))
    checkpoint = TrainingCheckpoint(
        engine, checkpoint_dir, keep_checkpoints, writes=_is_chief(engine)
    )
    start_epoch, start_step = checkpoint.restore()
    history: dict[str, list[float]] = {}
    callback_list = keras.callbacks.CallbackList(
        callbacks, model=engine.model, epochs=epochs, steps=steps_per_epoch, verbose=0
    )
    run = _Run(
        engine,
        dataset,
        epochs,
        steps_per_epoch,
        verbose,
        callback_list,
        checkpoint,
        checkpoint_every,
        log,
    )
    engine.model.stop_training = False
    callback_list.on_train_begin()
    try:
        for epoch in range(start_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            skip = start_step if epoch == start_epoch else 0
            logs = _train_epoch(run, epoch, skip)
            # An epoch ends with its last accumulate_steps window applied.
            engine.apply_accumulated()
            checkpoint.save(epoch + 1, 0)
            if validation_data is not None:
                val = evaluate(engine, validation_data, batch_size=batch_size)
                logs.update({f"val_{name}": value for name, value in val.items()})
                if verbose:
                    print("  " + "  ".join(f"val_{k}: {v:.4f}" for k, v in val.items()))
            for name, value in logs.items():
                history.setdefault(name, []).append(value)
            log.after_epoch(logs)
            callback_list.on_epoch_end(epoch, logs)
            if engine.model.stop_training:
                break
    finally:
        log.close()
    callback_list.on_train_end(history)
    return history


@dataclasses.dataclass
class _Run:
    """What stays the same for every epoch of one fit."""

    engine: Towers
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
    return _results(engine)


def evaluate(
    engine: Towers, data: Any, batch_size: int | None = None, verbose: int = 0
) -> dict[str, float]:
    """The loss and metrics over all of ``data``, computed by the towers.

    Args:
      engine: the Towers engine.
      data: see :func:`as_dataset`.
      batch_size: for array input.
      verbose: 1 for a progress bar.

    Returns:
      ``{"loss": mean loss over every example, metric name: value}``.
    """
    dataset = as_dataset(data, batch_size)
    verbose = verbose if _is_chief(engine) else 0
    engine.reset_metrics()
    bar = keras.utils.Progbar(_known_length(dataset)) if verbose else None
    for step, (x, y) in enumerate(dataset, 1):
        engine.evaluate_step(x, y)
        if bar is not None:
            bar.update(step)
    return _results(engine)


def _is_chief(engine: Towers) -> bool:
    return engine.cluster is None or engine.cluster.is_chief


def _results(engine: Towers) -> dict[str, float]:
    return {
        m.name: float(np.asarray(m.result()))
        for m in [engine.loss_tracker, *engine.metrics]
    }


def _bar_values(engine: Towers, rate: float) -> list[tuple[str, float]]:
    values = [(name, value) for name, value in _results(engine).items()]
    return [*values, ("examples/s", round(rate))]


def _progress_bar(epoch, epochs, total, engine, verbose):
    if not verbose:
        return None
    print(f"Epoch {epoch + 1}/{epochs}")
    names = ["loss", *[m.name for m in engine.metrics], "examples/s"]
    return keras.utils.Progbar(total, stateful_metrics=names)


def _known_length(dataset: tf.data.Dataset) -> int | None:
    length = int(dataset.cardinality())
    return length if length >= 0 else None

"""One ``fit``'s run, for ``towers/training/loop.py``: its resume, its epochs and
batches with their callbacks and checkpoints, the evaluate loop that fit's
validation shares, and Keras' callback list."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from towers._keras import pythonify_logs
from towers._keras.inputs import (
    convert_to_np_if_not_ragged,
    potentially_ragged_concat,
)
from towers.split import examples_of
from towers.training.arguments import check_callbacks
from towers.training.checkpoint import (
    TrainingCheckpoint,
    data_position_saveable,
    unsaveable_warning,
)
from towers.training.epochs import Epochs
from towers.training.inputs import unpack
from towers.training.preemption import Preemption
from towers.training.progress import ProgbarLogger
from towers.training.summaries import TrainingLog


@dataclasses.dataclass
class FitRun:
    """What the steps of one ``fit`` share."""

    callbacks: keras.callbacks.CallbackList
    checkpoint: TrainingCheckpoint
    checkpoint_every: int | None
    log: TrainingLog
    batches: Epochs
    preemption: Preemption
    trained: bool = False  # any step yet in this fit
    logs: dict | None = None  # the last step's logs, as the callbacks got them


def resume(
    engine: Any, checkpoint: TrainingCheckpoint, batches: Epochs, initial_epoch: int
) -> tuple[int, int]:
    """Restores ``checkpoint``'s newest save, if any, and stands ``batches``
    where it stopped; returns the epoch to start at and its steps done."""
    source = batches.source
    if checkpoint.directory is None:
        return initial_epoch, 0
    saved_epoch = checkpoint.saved("epoch")
    # Checkpoints before the data's position was saved: a pass an epoch.
    number = checkpoint.saved("data_pass")
    number = (saved_epoch or 0) if number is None else number
    iterator = None
    if source.positioning == "iterator":
        # The pass to resume (or the first), its position tried on it.
        iterator = batches.open(number)
        source.why_replay = data_position_saveable(iterator)
        if source.why_replay is None:
            batches.on_new_pass = checkpoint.follow
        else:
            source.positioning, iterator = "replay", None
    if source.positioning == "replay":
        unsaveable_warning(source.why_replay)
    if saved_epoch is None:
        # A fresh run's first pass is resumed by reading it again: the
        # first iterator a process makes comes in the same order in every
        # process, while restoring it would move a reshuffling pipeline's
        # seeds on by one draw (TensorFlow 2.21), so every later pass would
        # come in another order than the uninterrupted run's
        # (tests/training/test_resume.py). Every later pass is followed.
        checkpoint.restore()  # a damaged directory with none: its warning
        return initial_epoch, 0
    epoch, step, positioned = checkpoint.restore(iterator)
    read = checkpoint.saved("data_read")
    batches.resume(number, step if read is None else read, positioned)
    return epoch, step


def say_resumed(
    checkpoint: TrainingCheckpoint, epoch: int, step: int, epochs: int, verbose: Any
) -> None:
    """Prints, unless ``verbose`` is 0, where a fit resumed: its checkpoint,
    the epoch and batch it goes on at, or that nothing is left to train."""
    path = checkpoint.resumed_from()
    if path is None or verbose == 0:
        return
    if epoch >= epochs:
        print(f"Resumed from {path}: its {epoch} epochs are the {epochs} asked "
              "for; nothing left to train (pass more epochs to go on).")  # fmt: skip
        return
    after = f", after its batch {step}" if step else ""
    print(
        f"Resumed from {path}: training goes on at epoch {epoch + 1}/{epochs}{after}."
    )


def fit_epoch(engine: Any, run: FitRun, epoch: int, first: int) -> dict[str, Any]:
    """One epoch from its step ``first`` on; returns its loss and metrics as
    the model's ``get_metrics_result`` gives them: read when the callbacks
    are called, after validation, as in Keras' fit (a metric whose result is
    its variable then shows the validation's value, as there)."""
    if first == 0:  # else the checkpoint restored the epoch's metrics so far
        engine.reset_metrics()
    run.callbacks.on_epoch_begin(epoch)
    per_execution = engine.model.steps_per_execution
    for begin, end, batches in run.batches.executions(first, per_execution):
        fit_execution(engine, run, epoch, (begin, end), batches)
        if engine.model.stop_training:
            break
    else:
        if not run.trained and engine.steps_done == 0:  # data that ran out: warned
            raise ValueError(
                f"epoch {epoch + 1} got no batches: the data is empty or ran "
                "out (with steps_per_epoch, repeat() the dataset)"
            )
    # An epoch ends with its last accumulate_steps window applied.
    engine.apply_accumulated()
    run.checkpoint.save(epoch + 1, 0, run.batches.position)
    results = dict(engine.model.get_metrics_result())
    return _metrics_or_logs(results, run.logs)


def _metrics_or_logs(results: dict, logs: Any) -> dict:
    """Keras' rule for what an epoch returns: the metrics' ``results``, or
    the last step's ``logs`` where their keys are not theirs (a model's own
    step's), as the step returned them (nested: ``{"loss", "compile_metrics":
    {...}}``; Keras' callbacks flatten them, in the order of those keys)."""
    if not isinstance(logs, dict):
        return results
    return results if set(logs) == set(results) else dict(logs)


def fit_execution(
    engine: Any, run: FitRun, epoch: int, steps: tuple[int, int], batches: list
) -> None:
    """One execution (``steps_per_execution`` training steps, one call for
    batches of one shape), its callbacks (``steps``: Keras' first and last
    batch index), and the checkpoint after it."""
    begin, end = steps
    batches = [unpack(batch) for batch in batches]
    size = sum(int(examples_of(x)) for x, _, _ in batches)
    run.callbacks.on_train_batch_begin(begin)
    run.log.before_step(len(batches))
    run.preemption.before_step()
    started = time.perf_counter()
    stepped = engine.fit_steps(batches)
    # Reading the logs back waits for the steps, so the time is theirs.
    logs = pythonify_logs(stepped["logs"])
    run.log.after_step(logs, time.perf_counter() - started, size)
    run.trained = True
    # Keras' callbacks see what its train_step returns: every metric's running
    # value, the loss's included, or a model's own step's logs as it returned them.
    logs = stepped["reported"]
    run.logs = logs
    run.callbacks.on_train_batch_end(end, logs)
    done = begin + len(batches)
    # The epoch's last step is saved by the epoch-end checkpoint just after.
    every = run.checkpoint_every
    crossed = bool(every) and done // every > begin // every
    saved = crossed and done != run.batches.steps
    if saved:
        run.checkpoint.save(epoch, done, run.batches.position)
    if run.preemption.stop_now():
        if not saved:
            run.checkpoint.save(epoch, done, run.batches.position)
        where = f"epoch {epoch + 1} step {done}"
        run.preemption.exit(where, run.checkpoint.directory)


def evaluate_loop(
    engine: Any, batches: Epochs, callbacks: keras.callbacks.CallbackList
) -> dict[str, float]:
    """Keras' evaluate loop over one epoch of ``batches``."""
    engine.model.stop_evaluating = False
    callbacks.on_test_begin()
    engine.reset_metrics()
    per_execution = engine.model.steps_per_execution
    logs = None
    for begin, end, execution in batches.executions(0, per_execution):
        callbacks.on_test_batch_begin(begin)
        for batch in execution:
            logs = engine.evaluate_step(*unpack(batch))
        callbacks.on_test_batch_end(end, logs)
        if engine.model.stop_evaluating:
            break
    results = engine.get_metrics_result()
    logs = pythonify_logs(_metrics_or_logs(results, logs))
    callbacks.on_test_end(logs)
    return logs


def predict_loop(
    engine: Any, batches: Epochs, callbacks: keras.callbacks.CallbackList
) -> Any:
    """Keras' predict loop over one epoch of ``batches``: the outputs, in
    order, as NumPy."""
    engine.model.stop_predicting = False
    callbacks.on_predict_begin()
    outputs = []
    per_execution = getattr(engine.model, "steps_per_execution", 1)
    for begin, end, execution in batches.executions(0, per_execution):
        callbacks.on_predict_batch_begin(begin)
        done = [engine.predict_step(unpack(batch)[0]) for batch in execution]
        outputs += done
        callbacks.on_predict_batch_end(end, {"outputs": _concat(done)})
        if engine.model.stop_predicting:
            break
    callbacks.on_predict_end()
    return _concat(outputs)


def _concat(parts: list[Any]) -> Any:
    """The outputs of consecutive batches joined as Keras' predict joins
    them: NumPy, or ragged where their shapes differ after the batch axis
    (or they are ragged)."""
    joined = tf.nest.map_structure(
        lambda *each: potentially_ragged_concat(list(each)), *parts
    )
    return tf.nest.map_structure(convert_to_np_if_not_ragged, joined)


def make_callbacks(
    engine: Any,
    callbacks: Sequence[keras.callbacks.Callback] | None,
    verbose: int | str,
    epochs: int,
    steps: int | None,
) -> keras.callbacks.CallbackList:
    """Keras' ``CallbackList``, with towers' progress bar (``verbose``)
    unless the callbacks hold a progress bar of their own."""
    callbacks = list(callbacks or [])
    check_callbacks(callbacks)
    if verbose and not any(
        isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks
    ):
        callbacks.append(ProgbarLogger())
    return keras.callbacks.CallbackList(
        callbacks, model=engine.model, verbose=verbose, epochs=epochs, steps=steps
    )

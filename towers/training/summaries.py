"""TensorBoard logs of a training run: scalars per step and per epoch, and a trace.

``log_dir/train`` gets, at every step (x axis: the engine's ``steps_done``, which
counts every batch trained and is checkpointed, so a resumed run continues the same
curves), the batch's ``loss``, the running metrics,
``step_time`` in seconds, ``examples_per_second`` and the ``learning_rate``; and at
each epoch's end ``epoch_loss`` and ``epoch_<metric>``. ``log_dir/validation`` gets
the validation results as ``epoch_<name>``, so TensorBoard draws train and validation
on one chart as it does for Keras. With ``profile_steps=(N, M)`` the TensorFlow
profiler records steps N..M into ``log_dir/plugins/profile`` (TensorBoard's Profile
tab; ``pip install "towers[tensorboard]"``).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import keras
import numpy as np
import tensorflow as tf


class Logged(Protocol):
    """What the logs read of an engine (``towers.Towers`` has it)."""

    optimizer: keras.optimizers.Optimizer

    @property
    def steps_done(self) -> int: ...


class TrainingLog:
    """Writes one fit's summaries to ``log_dir``; does nothing without one.

    Args:
      engine: the Towers engine being trained.
      log_dir: the TensorBoard log directory, or None for no logs.
      profile_steps: ``(N, M)``: trace steps N to M (``steps_done`` counted from
        1, both included), or None.

    Raises:
      ValueError: ``profile_steps`` is not two integers with 1 <= N <= M, or is given
        without ``log_dir``.
    """

    def __init__(
        self,
        engine: Logged,
        log_dir: str | None,
        profile_steps: tuple[int, int] | None = None,
    ):
        self._engine = engine
        self._profile = _check_profile_steps(profile_steps, log_dir)
        self._profiling = False
        self._rate = 0.0
        self.log_dir = log_dir
        if log_dir is None:
            return
        self._train = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        self._validation = tf.summary.create_file_writer(
            os.path.join(log_dir, "validation")
        )

    def before_step(self, steps: int = 1) -> None:
        """Notes the step's learning rate; starts the profiler before the
        ``steps`` about to run (an execution's) if step N is among them."""
        if self.log_dir is None:
            return
        # Keras evaluates a LearningRateSchedule at the current iteration: read it
        # before the step advances the count, so it is the rate this step uses.
        self._rate = float(np.asarray(self._engine.optimizer.learning_rate))
        first = self._next_step()
        if self._profile and first <= self._profile[0] < first + steps:
            tf.profiler.experimental.start(self.log_dir)
            self._profiling = True

    def after_step(self, logs: dict, seconds: float, examples: int) -> None:
        """Writes the step's scalars; stops the profiler after the last traced step.

        Args:
          logs: the engine's step logs (loss, metrics): an execution's last.
          seconds: the step's (an execution's) wall time, host to result.
          examples: the step's (the execution's) examples.
        """
        if self.log_dir is None:
            return
        step = self._next_step() - 1
        if self._profiling and step >= self._profile[1]:
            self.close_profile()
        with self._train.as_default(step=step):
            for name, value in logs.items():
                for tag, number in _scalars(name, value):
                    tf.summary.scalar(tag, number)
            tf.summary.scalar("step_time", seconds)
            tf.summary.scalar("examples_per_second", examples / max(seconds, 1e-9))
            tf.summary.scalar("learning_rate", self._rate)

    def after_epoch(self, logs: dict[str, float]) -> None:
        """Writes the epoch's results; ``val_`` ones go to the validation run."""
        if self.log_dir is None:
            return
        step = self._next_step() - 1
        for name, value in logs.items():
            validation = name.startswith("val_")
            writer = self._validation if validation else self._train
            tag = "epoch_" + (name[len("val_") :] if validation else name)
            with writer.as_default(step=step):
                for each, number in _scalars(tag, value):
                    tf.summary.scalar(each, number)
        self._train.flush()
        self._validation.flush()

    def close_profile(self) -> None:
        """Stops a running trace (a fit that ends before step M stops it too)."""
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False

    def close(self) -> None:
        self.close_profile()
        if self.log_dir is not None:
            self._train.close()
            self._validation.close()

    def _next_step(self) -> int:
        return self._engine.steps_done + 1


def _scalars(name: str, value: Any) -> list[tuple[str, float]]:
    """A log's value as TensorBoard scalars: itself, or one per entry of a
    metric with several values (``F1Score``'s per class: ``name/0``, ...).

    >>> _scalars("f1", np.array([0.5, 1.0]))
    [('f1/0', 0.5), ('f1/1', 1.0)]
    """
    array = np.asarray(value)
    if array.ndim == 0:
        return [(name, float(array))]
    return [(f"{name}/{i}", float(v)) for i, v in enumerate(array.ravel())]


def _check_profile_steps(profile_steps, log_dir):
    if profile_steps is None:
        return None
    ok = (
        isinstance(profile_steps, (tuple, list))
        and len(profile_steps) == 2
        and all(isinstance(s, int) for s in profile_steps)
        and 1 <= profile_steps[0] <= profile_steps[1]
    )
    if not ok:
        raise ValueError(
            "profile_steps must be (N, M), two step numbers with 1 <= N <= M; "
            f"received {profile_steps!r}"
        )
    if log_dir is None:
        raise ValueError(
            f"profile_steps={tuple(profile_steps)} needs a log_dir to write the trace "
            "to; received log_dir=None"
        )
    return tuple(profile_steps)

"""Checkpoints of a training run: model, optimizer, epoch and step in the epoch,
and the input pipeline's position.

With ``accumulate_steps`` the gradient accumulators are saved too, and with
``epoch_metrics`` the running epoch's loss and metrics, so a run resumed inside
an epoch reports the whole epoch, as an uninterrupted run does. The position is
the tf.data iterator's own checkpoint (its shuffle buffer and the seeds of the
epochs still to come included), so a resumed run reads each example of the epoch
exactly once, in the order an uninterrupted run would, shuffled data included. A
pipeline whose position cannot be saved (``from_generator``, ``py_function``) is
resumed the old way, by skipping the batches already trained
(:func:`data_position_saveable` says why).

Saved with ``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``, which write
each checkpoint's files first and point the directory's ``checkpoint`` state file
at them last: a run killed while saving leaves the previous checkpoint as the
latest. A damaged or missing state file is not a fresh start: the checkpoints are
found by their own files (``towers/training/checkpoint_files.py``).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import tensorflow as tf

from towers.training.checkpoint_files import (
    STATE_FILE,
    check_writable,
    on_disk,
    rewrite,
    saved_elsewhere,
    state_damage,
    unreadable,
    variable_shapes,
)

# The checkpoint's key for the running epoch's metrics.
_METRICS = "epoch_metrics"
# Variables older checkpoints lack (the shuffle seed; the position in the
# data as a pass over it and the batches read from it): restored when saved.
_OPTIONAL = ("shuffle_seed", "data_pass", "data_read", "seed_states")


def _key(name: str) -> str:
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def _optional(key: str) -> str | None:
    """The name in :data:`_OPTIONAL` whose variable ``key`` is, if one."""
    found = (n for n in _OPTIONAL if key == _key(n) or key.startswith(f"{n}/"))
    return next(found, None)


class Checkpointable(Protocol):
    """What a checkpoint needs of an engine (``towers.Towers`` has it)."""

    variable_device: str

    @property
    def steps_done(self) -> int: ...

    def training_state(self) -> dict[str, Any]: ...

    def after_restore(self) -> None: ...


class TrainingCheckpoint:
    """Saves and restores one engine's training state in ``directory``.

    Args:
      engine: the engine whose ``training_state()`` is saved.
      directory: the checkpoint directory, or None for no checkpoints.
      keep: how many checkpoints to keep.
      writes: whether this process saves (in a cluster, the chief only; every
        worker restores).
      epoch_metrics: Keras metrics that add up over an epoch (the loss tracker
        and the user's metrics): saved with each checkpoint and restored when
        the saved ones match them. They are not training state: a checkpoint
        without them, or with other metrics, still resumes (they then start
        afresh, and the resumed epoch reports its remaining steps only).
    """

    def __init__(
        self,
        engine: Checkpointable,
        directory: str | None,
        keep: int = 3,
        writes: bool = True,
        epoch_metrics: Sequence[Any] = (),
    ):
        self.directory = directory
        self.writes = writes
        self._epoch_metrics = list(epoch_metrics)
        if directory is None:
            return
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1; received {keep!r}")
        if writes:
            check_writable(directory)
        with tf.device(engine.variable_device):
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
            # fit's shuffle of array data: its seed, so a resumed run's later
            # epochs come in the uninterrupted run's orders (-1: no shuffle).
            self.shuffle_seed = tf.Variable(-1, dtype=tf.int64, trainable=False)
            # Where in the data (towers/training/epochs.py): the pass, and how
            # many of its batches were read.
            self.data_pass = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.data_read = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._state = {
            **engine.training_state(),
            "epoch": self.epoch,
            "step": self.step,
            "shuffle_seed": self.shuffle_seed,
            "data_pass": self.data_pass,
            "data_read": self.data_read,
        }
        metric_variables = {
            f"{index}.{metric.name}.{v.name}".replace("/", "."): v
            for index, metric in enumerate(self._epoch_metrics)
            for v in metric.variables
        }
        self._metric_variables = metric_variables
        self._checkpoint = tf.train.Checkpoint(
            **self._state, **({_METRICS: metric_variables} if metric_variables else {})
        )
        # A damaged or missing state file: the checkpoints found by their files,
        # and the state file rewritten from them before the manager reads it (by
        # the process that saves; the others never need the manager).
        self._state_damage = state_damage(directory)
        self._found = on_disk(directory) if self._state_damage else []
        if self._state_damage and writes:
            rewrite(directory, self._found)
        self._manager = None
        if writes or not self._state_damage:
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, directory, max_to_keep=keep
            )
        self._engine = engine

    def follow(self, iterator: Any) -> None:
        """Saves ``iterator``'s position with every checkpoint from now on (the
        current epoch's iterator; None: no position)."""
        if self.directory is None or iterator is None:
            return
        self._checkpoint.data = self._state["data"] = iterator

    def restore(self, iterator: Any = None) -> tuple[int, int, bool]:
        """Restores the newest checkpoint that reads back whole, if there is one;
        a damaged newer one (truncated, garbled) is named in a warning.

        Args:
          iterator: a fresh iterator over the epoch's batches, to take the saved
            input position if the checkpoint has one; None to skip it.

        Returns:
          ``(epoch, step, positioned)``: the epoch to run, how many of its batches
          are done, and whether ``iterator`` now stands after them (else the
          caller skips ``step`` batches). ``(0, 0, False)`` for a fresh start.

        Raises:
          ValueError: the checkpoint was written by a different model or optimizer,
            or no kept checkpoint can be read; nothing is restored into the
            engine in either case.
        """
        if self.directory is None:
            return 0, 0, False
        path = self._resume_path()
        if path is None:
            if self._state_damage:
                warnings.warn(
                    f"the checkpoint state file {self._state_file} is damaged "
                    f"({self._state_damage}) and {self.directory} holds no "
                    "checkpoint (no ckpt-N.index); starting from step 0",
                    stacklevel=3,
                )
            return 0, 0, False
        if self._state_damage:
            warnings.warn(
                f"the checkpoint state file {self._state_file} is damaged "
                f"({self._state_damage}); resuming from the newest checkpoint found "
                f"in {self.directory} that reads back whole, {path}. The state "
                "file is rewritten from the checkpoints found.",
                stacklevel=3,
            )
        saved = {key for key, _ in tf.train.list_variables(path)}
        has_position = any(key.startswith("data/") for key in saved)
        positioned = has_position and iterator is not None
        if positioned:
            self.follow(iterator)
        elif has_position:
            warnings.warn(
                f"the checkpoint {path} holds the input pipeline's position, but "
                "this pipeline's cannot be restored; resuming by skipping the "
                "batches already trained",
                stacklevel=3,
            )
        metrics_match = self._check_matches(path)
        lacks = set(_OPTIONAL) - {_optional(key) for key in saved}
        # Without its metrics (other or none saved) or a variable older
        # checkpoints lack, through a root of what it holds, whose save counter
        # the saving root then takes.
        root = self._checkpoint
        if not metrics_match or lacks:
            parts = {k: v for k, v in self._state.items() if k not in lacks}
            if metrics_match and self._metric_variables:
                parts[_METRICS] = self._metric_variables
            root = tf.train.Checkpoint(**parts)
        try:
            status = root.restore(path)
        except tf.errors.OpError as error:
            raise ValueError(
                f"the checkpoint {path} cannot be restored: {error.message}"
            ) from None
        status.assert_existing_objects_matched()
        epoch, step = int(self.epoch.numpy()), int(self.step.numpy())
        if root is not self._checkpoint:
            self._checkpoint.save_counter.assign(root.save_counter)
        if not metrics_match:
            for metric in self._epoch_metrics:
                metric.reset_state()
            if step > 0:  # inside an epoch: its report will miss the steps done
                warnings.warn(
                    f"the checkpoint {path} holds other loss and metric states than "
                    "this run's (or none); resuming with them afresh, so epoch "
                    f"{epoch + 1} reports its steps after {step} only",
                    stacklevel=3,
                )
        self._engine.after_restore()
        return epoch, step, positioned

    def saved(self, name: str) -> int | None:
        """The value of the training state's ``name`` (``"epoch"``,
        ``"shuffle_seed"``) in the checkpoint a resume would restore; None for
        a fresh start, or a checkpoint without it (written before it was)."""
        path = self._resume_path() if self.directory is not None else None
        key = _key(name)
        if path is None or key not in dict(tf.train.list_variables(path)):
            return None
        return int(tf.train.load_variable(path, key))

    def resumed_from(self) -> str | None:
        """The checkpoint a fit resumes from, None for a fresh start."""
        return self._resume_path() if self.directory is not None else None

    def _resume_path(self) -> str | None:
        """The checkpoint a resume restores (the newest that reads back whole),
        None for a fresh start; found once (every tensor is read to check it)."""
        if not hasattr(self, "_path"):
            newest_first = self._kept()
            self._path = (
                self._readable_checkpoint(newest_first) if newest_first else None
            )
        return self._path

    @property
    def _state_file(self) -> str:
        return os.path.join(self.directory, STATE_FILE)

    def _kept(self) -> list[str]:
        """The kept checkpoints, newest first: as the state file names them, or
        found by their files when it is damaged or missing."""
        if self._state_damage:
            return list(reversed(self._found))
        newest_first = list(reversed(self._manager.checkpoints))
        latest = self._manager.latest_checkpoint
        if latest is not None and latest not in newest_first:
            newest_first.insert(0, latest)
        return newest_first

    def _readable_checkpoint(self, newest_first: list[str]) -> str:
        """The newest of ``newest_first`` whose every tensor reads back whole
        (the bundle's checksums included), warning of each newer one that does
        not.

        Read in full before anything is restored, so a damaged checkpoint never
        half-overwrites the engine.

        Raises:
          ValueError: no kept checkpoint can be read; each is named with why.
        """
        damaged = []
        for path in newest_first:
            why = unreadable(path)
            if why is None:
                for bad, reason in damaged:
                    warnings.warn(
                        f"the checkpoint {bad} is damaged ({reason}); resuming from "
                        f"the one before it, {path}",
                        stacklevel=4,
                    )
                return path
            damaged.append((path, why))
        raise ValueError(
            f"no checkpoint in {self.directory} can be read, so the run cannot "
            "resume; received "
            + "; ".join(f"{path}: {why}" for path, why in damaged)
            + ". Restore them from a backup, or use a new checkpoint_dir to start "
            "over."
        )

    def save(self, epoch: int, step: int, position: tuple[int, int] = (0, 0)) -> None:
        """Saves the state after ``step`` batches of ``epoch`` (0-based), with
        the ``position`` in the data: ``(pass, batches read from it)``."""
        if self.directory is None or not self.writes:
            return
        self.epoch.assign(epoch)
        self.step.assign(step)
        self.data_pass.assign(position[0])
        self.data_read.assign(position[1])
        # Numbered by the checkpoint's own save counter, so a save never rewrites
        # a kept checkpoint: TensorFlow rewrites an existing prefix's index in
        # place, and a kill meanwhile would damage it.
        self._manager.save()

    def _check_matches(self, path: str) -> bool:
        """Compares every saved variable's shape before anything is restored (the
        input position's size changes as it moves: it is not compared).

        Returns:
          Whether the saved epoch metrics are this run's (the same variables and
          shapes); they are compared apart, and may differ.
        """
        saved = {
            key: list(shape)
            for key, shape in tf.train.list_variables(path)
            if not key.startswith("data/")
        }
        mine = variable_shapes(self._checkpoint)
        metrics_match = _metric_shapes(saved) == _metric_shapes(mine)
        saved, mine = _without_metrics(saved), _without_metrics(mine)
        missing = sorted(k for k in set(mine) - set(saved) if not _optional(k))
        missing = saved_elsewhere(missing, mine, saved)
        wrong = [
            f"{key}: saved {saved[key]}, this model {mine[key]}"
            for key in sorted(set(mine) & set(saved))
            if saved[key] != mine[key]
        ]
        if missing or wrong:
            details = "; ".join(wrong[:3] + [f"not saved: {k}" for k in missing[:3]])
            raise ValueError(
                f"the checkpoint in {self.directory} was written by a different model "
                f"or optimizer; received {path} with {details}. Use a new "
                "checkpoint_dir for a new model."
            )
        return metrics_match


def _metric_shapes(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    return {k: v for k, v in shapes.items() if k.startswith(f"{_METRICS}/")}


def _without_metrics(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    return {k: v for k, v in shapes.items() if not k.startswith(f"{_METRICS}/")}


def unsaveable_warning(why: str) -> None:
    """Warns that fit cannot save the input's position (``why``)."""
    warnings.warn(
        f"fit cannot save this input's position with its checkpoints ({why}); a "
        "resumed run reads the batches already trained again and drops them, so "
        "the data must come in the same order every pass (a fixed shuffle seed "
        "and reshuffle_each_iteration=False)",
        stacklevel=4,
    )


def data_position_saveable(iterator: Any) -> str | None:
    """None if ``iterator``'s position can be checkpointed, else why not.

    Tried on the fresh iterator (nothing read yet, nothing buffered: cheap), so a
    pipeline that cannot be saved is found before the first step, not at the first
    save.

    >>> data_position_saveable(iter(tf.data.Dataset.range(4).batch(2))) is None
    True
    >>> gen = tf.data.Dataset.from_generator(lambda: iter([1]), output_types=tf.int32)
    >>> data_position_saveable(iter(gen))  # doctest: +ELLIPSIS
    '...PyFunc is stateful.'
    """
    with tempfile.TemporaryDirectory() as scratch:
        try:
            tf.train.Checkpoint(data=iterator).write(os.path.join(scratch, "probe"))
        except (tf.errors.OpError, TypeError, ValueError) as error:
            message = getattr(error, "message", str(error))
            return message.split("[Op:")[0].split("}}")[-1].strip()
    return None

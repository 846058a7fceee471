"""The checkpoint directory's state file, and resuming without it.

``tf.train.CheckpointManager`` keeps a small text file, ``checkpoint``, naming
the kept checkpoints; it is rewritten after every save. A kill or a full disk
while it is rewritten can leave it garbled, cut short or gone, and TensorFlow
then ignores it with one log line ("Checkpoint ignored"), so a run would start
over while its checkpoints sit whole beside it. So the state file is checked
first: when it is damaged or missing, the checkpoints are found by their own
files (``ckpt-N.index``), the newest that reads back whole is resumed from, and
the state file is rewritten from them (by the process that saves, before its
manager reads it; every later save rewrites it again).
"""

from __future__ import annotations

import os
import re

import tensorflow as tf

STATE_FILE = "checkpoint"
# CheckpointManager's default checkpoint_name: its files are ckpt-N.index, ...
PREFIX = "ckpt"


def state_damage(directory: str) -> str | None:
    """None if ``directory``'s state file names a checkpoint (or no checkpoint
    was ever saved there), else what is wrong with it.

    Example:
      >>> import tempfile
      >>> with tempfile.TemporaryDirectory() as empty:
      ...     state_damage(empty) is None
      True
    """
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return "missing" if on_disk(directory) else None
    try:
        # The parse TensorFlow's manager makes; it logs and returns None on a
        # garbled file, and raises on an empty one.
        state = tf.train.get_checkpoint_state(directory)
    except (ValueError, tf.errors.OpError) as error:
        return f"unreadable: {str(error).splitlines()[0][:200]}"
    if state is None or not state.model_checkpoint_path:
        return "unreadable: it does not parse as a checkpoint state"
    return None


def on_disk(directory: str) -> list[str]:
    """The prefixes of the checkpoints whose index file is in ``directory``,
    oldest (lowest number) first."""
    if not os.path.isdir(directory):
        return []
    numbers = []
    for name in os.listdir(directory):
        match = re.fullmatch(rf"{PREFIX}-(\d+)\.index", name)
        if match:
            numbers.append(int(match[1]))
    return [os.path.join(directory, f"{PREFIX}-{n}") for n in sorted(numbers)]


def rewrite(directory: str, prefixes: list[str]) -> None:
    """Replaces the state file with one naming ``prefixes`` (oldest first; the
    last is the latest), written to a temporary file and renamed over the old
    one; with no prefixes, removes the state file (it named nothing)."""
    path = os.path.join(directory, STATE_FILE)
    if not prefixes:
        if os.path.exists(path):
            os.remove(path)
        return
    names = [os.path.basename(p) for p in prefixes]  # relative, as the manager's
    tf.compat.v1.train.update_checkpoint_state(
        directory, model_checkpoint_path=names[-1], all_model_checkpoint_paths=names
    )

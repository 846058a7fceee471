"""The checkpoint directory's files: each checkpoint read back whole, the
directory's room to write, the state file (resuming without it), and the
keys a checkpoint holds (compared before a resume).

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
import tempfile

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


def unreadable(path: str) -> str | None:
    """None if every tensor of the checkpoint ``path`` reads back, else why not
    (a missing or truncated file, a garbled index, a checksum mismatch)."""
    try:
        reader = tf.train.load_checkpoint(path)
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype != tf.variant:  # the input position: read by its restore
                reader.get_tensor(key)
    # The reader raises IndexError for a data file cut short.
    except (tf.errors.OpError, ValueError, IndexError, RuntimeError) as error:
        message = getattr(error, "message", None) or str(error)
        return message.strip().splitlines()[0][:300]
    return None


def check_writable(directory: str) -> None:
    """Refuses, before the first step, a checkpoint directory this process cannot
    write: a file in its place, no permission, no space for a small file.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     check_writable(f.name)
    Traceback (most recent call last):
    ValueError: checkpoint_dir must be a directory; received ... a file...
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(
            f"checkpoint_dir must be a directory; received {directory!r}, which is "
            "a file"
        )
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".towers-probe-") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        why = error.strerror or str(error)
        raise ValueError(
            f"checkpoint_dir {directory!r} cannot be written ({why}); nothing was "
            "trained or saved. Choose a directory this process can write, with "
            "room for the model and optimizer."
        ) from None


def variable_shapes(checkpoint: tf.train.Checkpoint) -> dict[str, list[int]]:
    """Checkpoint key -> shape of every variable ``checkpoint`` saves.

    Read off a throwaway write of the current state, so the keys are exactly the
    ones TensorFlow would save (done once per resume, never per step).
    """
    with tempfile.TemporaryDirectory() as scratch:
        path = checkpoint.write(os.path.join(scratch, "probe"))
        return {
            key: list(shape)
            for key, shape in tf.train.list_variables(path)
            if not key.startswith("data/")
        }


def saved_elsewhere(missing: list[str], mine: dict, saved: dict) -> list[str]:
    """``missing`` less the keys saved under another path. A variable's key
    is the first path to it, so one reached first through an optimizer built
    since (a model's own step builds each at its first apply, over the
    variables it trains) was saved under that optimizer's path: each missing
    key takes a saved key of its shape that this state does not have."""
    spare: dict[str, int] = {}
    for key in set(saved) - set(mine):
        shape = str(saved[key])
        spare[shape] = spare.get(shape, 0) + 1
    left = []
    for key in missing:
        shape = str(mine[key])
        if spare.get(shape, 0) > 0:
            spare[shape] -= 1
        else:
            left.append(key)
    return left

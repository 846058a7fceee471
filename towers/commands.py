"""What the ``towers`` commands and examples share: a quiet TensorFlow start,
and the argument types (argparse ``type=``), each refusing bad text with the
text received.

TensorFlow's import writes lines from native code (absl's "All log messages
before absl::InitializeLog() ...", oneDNN's notice) that TF_CPP_MIN_LOG_LEVEL
does not reach, and its runtime logs warnings (a rendezvous aborting where an
example shows ``tf.split`` failing on purpose) that it does. A library should
not hide them from a user's own script (a GPU's missing library is said
there), so only towers' commands and examples start quietly, and their
``--verbose`` keeps them. Nothing here imports TensorFlow until called.
"""

from __future__ import annotations

import argparse
import os
import sys


def positive_int(text: str) -> int:
    """``--towers 4``: an integer >= 1.

    >>> positive_int("3")
    3
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text}")
    return value


def positive_float(text: str) -> float:
    """``--max-seconds 90``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number; received {text}")
    return value


def int_list(text: str) -> list[int]:
    """``--towers 1,2,4``: positive integers, comma-separated.

    >>> int_list("1,2,4")
    [1, 2, 4]
    """
    return [positive_int(part) for part in text.split(",")]


def name_list(text: str) -> list[str]:
    """``--placement cpu, balanced``: names, comma-separated, blanks dropped.

    >>> name_list("cpu, balanced,")
    ['cpu', 'balanced']
    """
    return [part.strip() for part in text.split(",") if part.strip()]


def start_tensorflow(verbose: bool = False) -> None:
    """Imports TensorFlow with its native start-up lines dropped and its log at
    errors only (``TF_CPP_MIN_LOG_LEVEL=2`` where unset); with ``verbose``,
    as TensorFlow starts by itself. A Python error is raised as ever.

    Example:
      >>> from towers.commands import start_tensorflow
      >>> start_tensorflow()  # already imported here: nothing to drop
    """
    if verbose:
        import tensorflow  # noqa: F401

        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)

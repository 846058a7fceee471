"""The argument types the ``towers`` commands share (argparse ``type=``); each
refuses bad text with the text received."""

from __future__ import annotations

import argparse


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

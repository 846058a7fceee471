"""The one rule for an option that a part of the engine cannot serve yet.

A copy per tower cannot accumulate steps; a cluster cannot spread variables over
its towers. Each part lists what it refuses, and :func:`refuse_unsupported` says
so before anything is built, in one form.
"""

from __future__ import annotations

from collections.abc import Mapping


def refuse_unsupported(who: str, asked: Mapping[str, bool], instead: str) -> None:
    """Raises on the first option in ``asked`` that is present.

    Args:
      who: the part that refuses, e.g. ``"placement='replicated'"``.
      asked: option (as the user wrote it) -> whether it was asked for.
      instead: what to do instead, one sentence.

    Raises:
      ValueError: ``"{who} does not support {option} yet; ..."``.

    Example:
      >>> refuse_unsupported("a cluster", {"x=1": False, "y=2": True}, "Drop y.")
      Traceback (most recent call last):
      ValueError: a cluster does not support y=2 yet; received them together. Drop y.
    """
    for option, present in asked.items():
        if present:
            raise ValueError(
                f"{who} does not support {option} yet; received them together. "
                f"{instead}"
            )

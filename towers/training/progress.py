"""What ``fit``, ``evaluate`` and ``predict`` show and return: Keras' progress
bar, and the History."""

from __future__ import annotations

import sys
from typing import Any

import keras

from towers._keras.inputs import set_in_place


class History(keras.callbacks.History):
    """Keras' ``History`` (``history.history["loss"]``, ``history.epoch``) that
    also reads as its dict (``history["loss"]``, ``sorted(history)``).

    >>> h = History()
    >>> h.history = {"loss": [0.5, 0.25]}
    >>> h["loss"], list(h), len(h)
    ([0.5, 0.25], ['loss'], 1)
    """

    def __getitem__(self, name: str) -> list[float]:
        return self.history[name]

    def __iter__(self):
        return iter(self.history)

    def __len__(self) -> int:
        return len(self.history)

    def __contains__(self, name: object) -> bool:
        return name in self.history

    def keys(self):
        return self.history.keys()

    def items(self):
        return self.history.items()

    def values(self):
        return self.history.values()


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar (``verbose=1``), in place on a terminal only: into a
    file (a job's log, ``make demo > log``) each epoch is one line, as Keras'
    ``verbose=2`` writes it, not a line of ``\\r`` updates.

    >>> import io
    >>> bar = ProgbarLogger()
    >>> bar.set_params({"verbose": 1, "epochs": 1, "steps": 2})
    >>> bar._maybe_init_progbar()  # what on_epoch_begin does
    >>> bar.progbar.verbose  # stdout is not a terminal under doctest
    2
    """

    def _maybe_init_progbar(self) -> None:
        fresh = self.progbar is None
        super()._maybe_init_progbar()
        if fresh and self.verbose == 1 and not _is_terminal(sys.stdout):
            set_in_place(self.progbar, False)
            self.progbar.verbose = 2  # its line at the end, none before


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())

"""What ``fit`` shows and returns: a progress line per epoch, and the History."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import keras


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


class Progress:
    """One epoch's progress line: counts and rates as whole numbers with
    thousands separators, losses and metrics to four decimals.

    >>> Progress.format("examples/s", 12345.6), Progress.format("loss", 0.123456)
    ('examples/s: 12,346', 'loss: 0.1235')
    """

    def __init__(self, total: int | None, out: Any = None):
        self.total = total
        self.out = out if out is not None else sys.stdout
        self.started = time.perf_counter()

    def update(self, step: int, values: Mapping[str, float], done: bool = False):
        where = f"{step}/{self.total}" if self.total else f"{step}"
        seconds = time.perf_counter() - self.started
        parts = [where, f"{seconds:.1f} s"]
        parts += [self.format(name, value) for name, value in values.items()]
        end = "\n" if done or step == self.total else ""
        self.out.write("\r" + " - ".join(parts) + end)
        self.out.flush()

    @classmethod
    def summary(cls, steps: int, seconds: float, values: Mapping[str, float]) -> str:
        """An epoch's one line (``verbose=2``): its steps, time and results.

        >>> Progress.summary(4, 0.25, {"loss": 0.5, "val_loss": 0.75})
        '4/4 - 0.2 s - loss: 0.5000 - val_loss: 0.7500'
        """
        parts = [f"{steps}/{steps}", f"{seconds:.1f} s"]
        return " - ".join(parts + [cls.format(k, v) for k, v in values.items()])

    @staticmethod
    def format(name: str, value: float) -> str:
        if name.endswith("/s") or float(value).is_integer() and abs(value) >= 1:
            return f"{name}: {round(value):,}"
        return f"{name}: {value:.4f}"

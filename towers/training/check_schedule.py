"""When the engine checks its step against one device's (``check.py``):
its first step, the first batch of each new trace of the step (a new input
signature, new trainable variables: the step may read the model anew), and
spot checks through the run, where a step that changes after its first
steps (a coupling a step counter switches on) is found."""

from __future__ import annotations

import warnings
from typing import Any

from towers.training.check import checked
from towers.training.check_state import not_compared
from towers.training.comparison import Comparison
from towers.training.twin import drop_twin

# A spot check every SPOT_CHECKS steps (and one at a tenth of it): one
# device's step on that step's batch, from the same state, before its update
# is kept (``Towers(spot_checks=)``).
SPOT_CHECKS = 2000


def spot_due(step: int, every: int | None) -> bool:
    """Whether step ``step`` (counted from 1) is a spot check's.

    >>> [s for s in range(1, 3001) if spot_due(s, 1000)]
    [100, 1000, 2000, 3000]
    """
    return bool(every) and (step == every // 10 or step % every == 0)


class Checks:
    """The engine's step checked against one device's (:func:`checked`): a
    part the engine holds, wrapping its steps at the first step, at each
    new trace of the step (a new input signature, new trainable variables)
    and at spot checks every ``spot_checks`` steps (None: none).

    ``engine`` runs its steps in ``_run_steps(prepared batches)``;
    ``first_step``: the first step and each new trace are checked."""

    def __init__(self, engine: Any, first_step: bool, spot_checks: int | None):
        self.engine = engine
        self.unchecked = self.traces = first_step
        self.spot_checks = spot_checks_of(spot_checks)
        self._steps_seen: int | None = None  # steps done, counted since read

    def run(self, batches: list[tuple]) -> dict:
        """The engine's steps on ``batches``, checked where :meth:`due` says."""
        engine, due = self.engine, self.due(batches)
        if due is None:
            out = engine._run_steps(batches)
        else:
            run = lambda: engine._run_steps(batches)  # noqa: E731
            # The float64 twin at the first step and each new trace (a trace
            # of its own, made again: its copies dropped between); not at a
            # spot check, whose step was traced and checked so before.
            when, twin = due
            out, comparison = checked(engine, batches, run, when=when, twin=twin)
            if self.unchecked and comparison.skipped:
                warnings.warn(f"towers' first step was {comparison}", stacklevel=5)
            self.unchecked = False
            drop_twin(engine)
        if self._steps_seen is not None:
            self._steps_seen += len(batches)
        return out

    def check(self, batches: list[tuple]) -> Comparison:
        """The comparison on ``batches``, nothing kept (``Towers.check``)."""
        run = lambda: self.engine._run_steps(batches)  # noqa: E731
        return checked(self.engine, batches, run, keep=False)[1]

    def restored(self) -> None:
        """The steps counter was restored: read it again at the next step."""
        self._steps_seen = None

    def due(self, batches: list[tuple]) -> tuple[str, bool] | None:
        """Why the steps on ``batches`` are checked, and whether in the
        float64 twin too; or None."""
        engine = self.engine
        if self.unchecked:
            return "its first step", True
        # Traced here, before the run, outside a cluster's (never checked).
        if self.traces and engine.cluster is None:
            if engine._compiled.traces_anew(batches) and not_compared(engine) is None:
                steps = self._steps(batches, True)
                why = "a new trace of the step: new shapes or trainables"
                return f"{steps} ({why})", True
        # The steps counted here (reading the counter costs 0.6 % of a
        # small step); read again where one is a spot check's.
        if self._steps_seen is None:
            self._steps_seen = engine.steps_done
        if self._spot_due(self._steps_seen, len(batches)):
            self._steps_seen = engine.steps_done
            if self._spot_due(self._steps_seen, len(batches)):
                if not_compared(engine) is None:
                    every = f"a spot check, every {self.spot_checks} steps"
                    return f"{self._steps(batches)} ({every})", False
        return None

    def _spot_due(self, done: int, count: int) -> bool:
        return any(
            spot_due(s, self.spot_checks) for s in range(done + 1, done + count + 1)
        )

    def _steps(self, batches: list, read: bool = False) -> str:
        # "step N" (or "steps N-M") of the steps on batches.
        if read or self._steps_seen is None:
            self._steps_seen = self.engine.steps_done
        first, last = self._steps_seen + 1, self._steps_seen + len(batches)
        return f"step {first}" if first == last else f"steps {first}-{last}"


def spot_checks_of(every: Any) -> int | None:
    """``Towers``' ``spot_checks``, checked: a number of steps, or None.

    >>> spot_checks_of(0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: spot_checks must be a number of steps >= 1, ...; received 0
    """
    if every is not None and (
        isinstance(every, bool) or not isinstance(every, int) or every < 1
    ):
        raise ValueError(
            "spot_checks must be a number of steps >= 1, or None to turn them "
            f"off; received {every!r}"
        )
    return every

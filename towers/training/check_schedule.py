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


class CheckedSteps:
    """For an engine (``Towers``): its step checked against one device's
    (:func:`checked`) at its first step, at each new trace of the step (a
    new input signature, new trainable variables) and at spot checks, and
    :meth:`check` on any batch. The engine runs its steps in
    ``_run_steps(prepared batches)``; ``unchecked``: its first step is still
    to check; ``check_traces``, ``spot_checks``: what else is."""

    unchecked = True
    check_traces = True
    spot_checks: int | None = SPOT_CHECKS
    _steps_seen: int | None = None  # steps done, counted since last read

    def _schedule_checks(self, first_step: bool, spot_checks: int | None) -> None:
        """The first step and each new trace checked, or neither; a spot
        check every ``spot_checks`` steps, or none (None)."""
        self.unchecked = self.check_traces = first_step
        self.spot_checks = spot_checks_of(spot_checks)

    def _run_checked(self, batches: list[tuple]) -> dict:
        """``_run_steps(batches)``, checked where :meth:`_check_due` says."""
        due = self._check_due(batches)
        if due is None:
            out = self._run_steps(batches)
        else:
            run = lambda: self._run_steps(batches)  # noqa: E731
            # The float64 twin at the first step and each new trace (a trace
            # of its own, made again: its copies dropped between); not at a
            # spot check, whose step was traced and checked so before.
            when, twin = due
            out, comparison = checked(self, batches, run, when=when, twin=twin)
            if self.unchecked and comparison.skipped:
                warnings.warn(f"towers' first step was {comparison}", stacklevel=4)
            self.unchecked = False
            drop_twin(self)
        if self._steps_seen is not None:
            self._steps_seen += len(batches)
        return out

    def _check_due(self, batches: list[tuple]) -> tuple[str, bool] | None:
        """Why the steps on ``batches`` are checked, and whether in the
        float64 twin too; or None."""
        if self.unchecked:
            return "its first step", True
        # Traced here, before the run, outside a cluster's (never checked).
        if self.check_traces and self.cluster is None:
            if self._compiled.traces_anew(batches) and not_compared(self) is None:
                steps = self._steps(batches, True)
                why = "a new trace of the step: new shapes or trainables"
                return f"{steps} ({why})", True
        # The steps counted here (reading the counter costs 0.6 % of a
        # small step); read again where one is a spot check's.
        if self._steps_seen is None:
            self._steps_seen = self.steps_done
        if self._spot_due(self._steps_seen, len(batches)):
            self._steps_seen = self.steps_done
            if self._spot_due(self._steps_seen, len(batches)):
                if not_compared(self) is None:
                    every = f"a spot check, every {self.spot_checks} steps"
                    return f"{self._steps(batches)} ({every})", False
        return None

    def _spot_due(self, done: int, count: int) -> bool:
        return any(
            spot_due(s, self.spot_checks) for s in range(done + 1, done + count + 1)
        )

    def _steps(self, batches: list, read: bool = False) -> str:
        """``"step N"`` (or ``"steps N-M"``) of the steps on ``batches``."""
        if read or self._steps_seen is None:
            self._steps_seen = self.steps_done
        first, last = self._steps_seen + 1, self._steps_seen + len(batches)
        return f"step {first}" if first == last else f"steps {first}-{last}"

    def check(self, x: Any, y: Any = None, sample_weight: Any = None) -> Comparison:
        """Compares towers' step on one batch with the model's own
        ``train_step`` on one device: every variable's relative difference;
        nothing is kept, every variable is put back. ``print`` it for a table.

        >>> eng = make_engine()
        >>> x, y = np.ones((5, 3), "f4"), np.zeros((5, 1), "f4")
        >>> comparison = eng.check(x, y)
        >>> [d.path.rsplit("/")[-1] for d in comparison.differences]
        ['kernel', 'bias', 'iteration', 'learning_rate', 'loss']
        >>> comparison.differs  # none beyond rounding
        []
        >>> int(eng.optimizer.iterations), eng.steps_done  # nothing kept
        (0, 0)
        """
        batch = [self._training_batch("check", x, y, sample_weight)]
        run = lambda: self._run_steps(batch)  # noqa: E731
        return checked(self, batch, run, keep=False)[1]


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

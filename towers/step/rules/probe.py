"""The one probe: how a tower's work reads its batch, found before the first
step.

The work (a model's own ``train_step`` or ``test_step``, or the built-in
step's forward pass and loss terms, ``loss_terms.py``) runs on two
examples together and on each alone, nothing kept (``trial.py``). Each
number, less its terms that read no example, is a mean (the mean of its
values alone), a sum, or couples the examples (a contrastive loss), to be
gathered or refused by name before any update. Draws take their rows of
the two examples' draw; BatchNormalization uses its moving moments."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import tensorflow as tf

from towers._keras.current import this_tower
from towers.split import take_rows, units_of
from towers.step.rules import places
from towers.step.rules.loss_kinds import (
    PROBE_ATOL,
    Kind,
    kind_of,
    less_free,
    readings,
)
from towers.step.rules.trial import Trial
from towers.step.work.hooks import raised_in_towers

# Pairs of examples tried while a loss is zero on them (both readings fit).
PAIRS = 4


@dataclasses.dataclass(frozen=True)
class Measured:
    """A number the probe found neither a mean nor a sum over the examples:
    its value on two examples together, and the mean of its values on each."""

    name: str
    together: float
    each: float
    own_loss: bool = False  # the model's compute_loss, not an add_loss term

    def __str__(self) -> str:
        apart = abs(self.together - self.each) / max(
            abs(self.together), abs(self.each), PROBE_ATOL
        )
        return (
            f"{self.name} is {self.together:.6g} on the first two examples of the "
            f"first batch together and {self.each:.6g} as the mean of its values "
            f"on each alone ({apart:.1%} apart)"
        )


@dataclasses.dataclass
class Found:
    """What :func:`probe` found: each loss's kind in call order (None: not
    probed), each returned number's by key (``neither``: it couples the
    examples; ``measured``: its values), the work's kept outputs per part."""

    losses: list[Kind] | None
    logs: dict[str, Kind]
    measured: dict[str, Measured] = dataclasses.field(default_factory=dict)
    neither: set[str] = dataclasses.field(default_factory=set)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    unprobed: str | None = None  # why the work ran on no part, if it did not


def probe(
    model: keras.Model,
    batch: tuple,
    hook: Any = "train_step",
    towers: int = 2,
    learned: places.Learned | None = None,
) -> Found:
    """How ``hook`` (``"train_step"``, ``"test_step"``, or ``(name, work)``: a
    function of the packed data returning numbers by key) reads ``batch``.
    A loss with a value per example is a sum (the tape sums it). Parts of one
    example come first; a work that fails on them (a ``top_k`` over the
    batch) is probed on parts of a shard's rows; one that runs on neither is
    not probed (``unprobed`` says why): the first-step check decides. What
    it learns of the work's draws goes to ``learned`` (the runner's).

    Raises:
      ValueError: a loss neither a mean nor a sum over the examples; a
        towers' refusal raised while the work ran."""
    size = units_of(batch)[0]  # a part's rows each (towers/split.py)
    shard = size // max(towers, 1)
    tried = sorted({1, shard} - {0}) if size >= 2 else []
    failed = None
    for unit in tried:
        try:
            return _probe(model, batch, hook, size, unit, learned)
        except Exception as error:  # noqa: BLE001 - the model's, or ours: below
            if raised_in_towers(error):
                raise
            failed = failed or error
    if failed is None:
        return Found(None, {})
    named = misfit(model, hook if isinstance(hook, str) else hook[0], failed)
    if named is not None:
        raise named from failed
    first = (str(failed).strip().splitlines() or [""])[0][:160]
    why = f"{type(failed).__name__}: {first}"
    name = hook if isinstance(hook, str) else "forward pass"
    warnings.warn(
        f"towers' probe of how {type(model).__name__}'s {name} reads its batch "
        f"did not run on one example, nor on a tower's share ({why}): whether "
        "its towers' step is one device's is left to the first-step check "
        "(check_first_step=True).",
        stacklevel=3,
    )
    return Found(None, {}, unprobed=why)


def _probe(
    model: keras.Model, batch: tuple, hook: Any, size: int, unit: int, learned: Any
) -> Found:
    """:func:`probe` on parts of ``2 * unit`` units together and ``unit``
    alone."""
    trial = Trial(model, hook, places.size_of(batch[0]), learned or places.Learned())
    kinds: list[Any] = []
    found = Found([], {})
    for first in range(0, size - 2 * unit + 1, 2 * unit)[:PAIRS]:
        parts = [_rows(batch, first, first + 2 * unit)]
        parts += [
            _rows(batch, first + i * unit, first + (i + 1) * unit) for i in (0, 1)
        ]
        losses, returned, kept = trial.recorded(parts)
        losses = [less_free([pair.numpy() for pair in part]) for part in zip(*losses)]
        for key in returned[0] if first == 0 else []:
            pairs = [variant[key].numpy() for variant in returned]
            together, one, other = (float(value) for value, _ in pairs)
            found.measured[key] = Measured(key, together, (one + other) / 2)
            less, apart = less_free(pairs)
            kind = kind_of(model, (less, apart), None)
            if kind:
                found.logs[key] = kind
            elif not readings(*less):
                found.neither.add(key)
        found.outputs = found.outputs or kept
        if trial.gathers:  # the whole batch's loss on every tower
            return Found(["mean"] * len(losses), {})
        read = [  # a value per row the tape sums, unless its values say else
            kind_of(model, value, k) or ("sum" if rows else None)
            for k, (rows, value) in enumerate(zip(trial.per_row(), losses))
        ]
        kinds = [old or new for old, new in zip(kinds, read)] if kinds else read
        if all(kinds):
            break
    found.losses = [kind or "mean" for kind in kinds]  # 0 on every pair: either
    return found


def gathered() -> None:
    """Marks the step probed as one whose loss is the whole batch's on
    every tower (it called ``towers.gather``)."""
    trial = this_tower().trial
    if trial is not None:
        trial.gathers = True


def misfit(model: keras.Model, hook: str, error: ValueError) -> ValueError | None:
    """``error``, raised while ``hook`` ran on a part of the batch, named
    where the part's shapes did not fit the step's (None: another error)."""
    text = str(error)
    if not any(k in text for k in ("Dimensions must be equal", "Incompatible")):
        return None
    return ValueError(
        f"{type(model).__name__}.{hook} on towers runs on each tower's share of "
        f"the batch, and a share did not fit it: {text.splitlines()[0]} A shape "
        "the step takes from a fixed batch size, not from its data "
        "(keras.ops.shape(x)[0]), does not fit a share: read it from the data, "
        "or train on one device. Nothing was updated."
    )


def _rows(batch: tuple, start: int, stop: int) -> tuple:
    """Units ``[start, stop)`` of ``batch``: so many rows of each part."""
    units, rows = units_of(batch)
    taken = [
        None if n is None else take_rows(leaf, start * n // units, stop * n // units)
        for leaf, n in zip(tf.nest.flatten(batch), rows)
    ]
    return tf.nest.pack_sequence_as(batch, taken)

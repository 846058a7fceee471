"""What a check of the step found (``check.py``): every variable's
relative difference against one device's, a verdict, and the refusal that
names what differs, its layers and what to do."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Difference:
    """One variable's change under towers against one device's.

    Attributes:
      path: the variable's path (``dense/kernel``); ``whose``: its layer,
        metric or optimizer (``layer dense``).
      relative: ``||Δ_towers - Δ_keras|| / ||Δ_keras||`` over the elements
        compared (0.0 where both left it alone).
      differs: beyond rounding (see the module docstring).
      noise: how many elements were left out, their one-device gradient at
        the noise of its sums.
    """

    path: str
    whose: str
    relative: float
    differs: bool
    noise: int = 0

    @property
    def reported(self) -> bool:
        return self.whose.startswith("metric ")


@dataclasses.dataclass
class Comparison:
    """Every compared variable's :class:`Difference`; ``skipped``: why the
    check could not compare, or None; ``twin``: the same step compared in
    the model's float64 twin (``twin.py``), where it has one; ``on``: what
    it ran on where not the whole batch on every tower."""

    differences: list[Difference]
    skipped: str | None = None
    twin: Comparison | None = None
    on: str = ""

    @property
    def differs(self) -> list[Difference]:
        """The variables that moved differently (what refuses a first step):
        in the model's dtype, else in its float64 twin."""
        return self._own() or self._twins()

    @property
    def in_twin(self) -> bool:
        """Whether what differs was found in the float64 twin alone."""
        return not self._own() and bool(self._twins())

    @property
    def rounding(self) -> bool:
        """Whether what differs in the model's dtype is rounding: its float64
        twin (asked where it may tell, ``twin.py``) found the step one
        device's."""
        twin = self.twin
        found = twin is not None and not (twin.skipped or twin.differs)
        return found and bool(self._apart())

    def _own(self) -> list[Difference]:
        return [] if self.rounding else self._apart()

    def _apart(self) -> list[Difference]:
        return [d for d in self.differences if d.differs and not d.reported]

    def _twins(self) -> list[Difference]:
        return self.twin.differs if self.twin is not None else []

    @property
    def reports_differ(self) -> list[Difference]:
        """The metrics whose results differ (what fit reports, warned of)."""
        return [d for d in self.differences if d.differs and d.reported]

    def __str__(self) -> str:
        """A verdict line, then every variable's relative difference."""
        if self.skipped:
            return f"not compared: {self.skipped}"
        width = max([len(d.path) for d in self.differences] + [8])
        lines = [self.verdict(), ""]
        lines += [f"{'variable':<{width}}  relative difference (towers vs one device)"]
        for d in self.differences:
            mark = "  DIFFERS" if d.differs else ""
            if d.noise:
                mark += (
                    f"  ({d.noise} elements left out: one device's gradient "
                    "there is rounding noise)"
                )
            lines.append(f"{d.path:<{width}}  {d.relative:.3g}{mark}")
        if self.twin is not None:
            on = f", {self.twin.on}" if self.twin.on else ""
            lines += ["", f"In the model's float64 twin (rounding near 1e-13{on}):"]
            lines += str(self.twin).splitlines()
        return "\n".join(lines)

    __repr__ = __str__  # at a prompt, the table

    def verdict(self) -> str:
        """One line: one device's within rounding, or what differs."""
        if self.differs:
            where = " in the model's float64 twin" if self.in_twin else ""
            return (
                f"NOT one device's step: {len(self.differs)} variables moved "
                f"differently beyond rounding{where} ({_listed(self.differs)})"
            )
        largest = max(self.differences, key=lambda d: d.relative, default=None)
        within = "one device's step, within rounding" + (
            f" (largest: {largest.path} {largest.relative:.2g})" if largest else ""
        )
        if self.rounding:
            within += (
                "; what moved apart in the model's dtype is rounding: its float64 "
                "twin's step is one device's"
            )
        if self.reports_differ:
            return (
                f"{within}; what fit reports differs ({_listed(self.reports_differ)})"
            )
        return within

    def refusal(self, coupling: str | None = None, when: str = "its first step") -> str:
        """The error naming each variable that differs, its layer and by how
        much, at ``when`` (the step, and why it was checked); ``coupling``:
        the layer whose outputs couple the examples."""
        named = "; ".join(
            f"{d.path} ({d.whose}) {d.relative:.3g} relative" for d in self.differs[:5]
        )
        more = len(self.differs) - 5
        named += f"; and {more} more" if more > 0 else ""
        owners = list(dict.fromkeys(d.whose for d in self.differs))
        why = (
            f" Its forward pass couples the batch's examples from layer "
            f"{coupling!r} on (its outputs on two examples together are not its "
            "outputs on each alone), where the towers cannot meet. Pass "
            "coupled_losses='per_tower' to take each tower's on its own shard "
            "(as MirroredStrategy does: the update then differs from one "
            "device's; warned), or train on one device."
            if coupling
            else f" No rule towers has explains it: the forward pass does not "
            "couple two examples, and no draw or assignment was named; what "
            f"differs is in {', '.join(owners[:4])}"
            + (" and more" if len(owners) > 4 else "")
            + ". Train this model on one device, or pass check_first_step=False "
            "to train on towers anyway (to other weights than one device's); "
            "Towers.check(x, y) prints every variable, which a report of the "
            "model to towers should carry."
        )
        twin = (
            " in the model's float64 twin (its config rebuilt in float64"
            + (f", {self.twin.on}" if self.twin.on else "")
            + ", where rounding is near 1e-13 and cannot hide a difference of "
            "this size)"
            if self.in_twin
            else ""
        )
        return (
            f"towers' step at {when} is not one device's on this model: checked "
            "against the model's own train_step on the whole batch on one "
            f"device{twin}, these variables moved differently: {named}. Nothing "
            f"was updated.{why}"
        )


def _listed(found: list[Difference]) -> str:
    named = ", ".join(f"{d.path} {d.relative:.2g}" for d in found[:3])
    return named + (f" and {len(found) - 3} more" if len(found) > 3 else "")

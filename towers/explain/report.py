"""The report of ``towers explain``: a text table and a diagram (devices as columns,
the step's stages as rows, the tensors that crossed devices as arrows)."""

from __future__ import annotations

import re
from typing import Any

# Rows of the diagram, in data-path order; a tower's forward and backward passes
# share the "forward", "XLA" and "backward" rows.
ROWS = (
    "variables",
    "split",
    "forward",
    "XLA",
    "backward",
    "combine",
    "across workers",
    "apply",
    "metrics",
)


def render(explanation: Any) -> str:
    """The text report."""
    e = explanation
    lines = [
        f"one training step of {sum(e.sizes)} examples, read from the graphs "
        "TensorFlow placed and ran",
        f"towers:          {len(e.devices)} on {', '.join(e.devices)}; "
        f"shards of {e.sizes} examples",
        f"variable device: {e.variable_device} (placement {e.placement!r})",
    ]
    if e.workers > 1:
        lines.append(
            f"workers:         {e.workers}; this is one worker's step, the others' "
            "are the same"
        )
    if e.coupled:
        lines.append("loss terms that couple the batch's examples:")
        lines += [f"  {term}" for term in e.coupled]
    if e.assigned:
        lines.append("variables the forward pass assigns, once a step:")
        lines += [f"  {line}" for line in e.assigned]
    if e.meetings:
        lines.append("the model's own train_step: the towers meet at")
        lines += [f"  {line}" for line in e.meetings]
    lines += ["", *_variables(e), "", summary(e)]
    return "\n".join(lines)


def summary(explanation: Any) -> str:
    """The report without its list of variables: ops by stage and device, where
    the combine and apply ran, and the bytes that crossed devices."""
    e = explanation
    return "\n".join([*_ops(e), "", *_xla(e), *_where(e), "", *_bytes(e)])


def _variables(e: Any) -> list[str]:
    total = sum(v.bytes for v in e.variables)
    lines = [
        f"variables: {len(e.variables)}, {size(total)}",
        f"  {'owner':<10} {'name':<44} {'shape':<16} {'dtype':<8} {'bytes':>9}  device",
    ]
    for v in e.variables:
        lines.append(
            f"  {v.owner:<10} {v.name:<44} {str(v.shape):<16} {v.dtype:<8} "
            f"{v.bytes:>9}  {v.device}"
        )
    return lines


def _ops(e: Any) -> list[str]:
    devices = e.all_devices
    width = max(7, *(len(short(d)) + 1 for d in devices))
    lines = [
        "ops TensorFlow ran in one step, by stage and device (a tower's reads of "
        "the\nshared variables run where they live, so they count on that device):",
        f"  {'stage':<18}" + "".join(f"{short(d):>{width}}" for d in devices),
    ]
    for stage, counts in e.ops.items():
        row = "".join(f"{counts.get(d, 0) or '.':>{width}}" for d in devices)
        lines.append(f"  {stage:<18}{row}")
    return lines


def _xla(e: Any) -> list[str]:
    """The towers' XLA computations (``jit_compile``), with a blank line after."""
    if not e.xla:
        return []
    lines = ["XLA computations (jit_compile): each one op in the placed graph"]
    for (stage, device), calls in _grouped(e.xla):
        if len(calls) == 1:
            what = f"{calls[0].function}, {calls[0].ops} ops compiled"
        else:  # a pass cut where the towers meet (towers/step/run/phases.py)
            ops = "+".join(str(c.ops) for c in calls)
            what = f"{len(calls)} phases, the towers' sums between: {ops} ops"
        lines.append(f"  {stage:<18} on {device}: {what}")
    return [*lines, ""]


def _grouped(calls: list[Any]) -> list[tuple[tuple[str, str], list[Any]]]:
    """``calls`` by stage and device, in the order each first appears."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for call in calls:
        groups.setdefault((call.stage, call.device), []).append(call)
    return list(groups.items())


def _where(e: Any) -> list[str]:
    lines = []
    for stage in ("combine", "across workers", "apply"):
        if stage in e.ops:
            on = ", ".join(f"{d} ({e.ops[stage][d]} ops)" for d in e.ran_on(stage))
            lines.append(f"{stage + ' ran on':<20} {on}")
    return lines


def _bytes(e: Any) -> list[str]:
    count = sum(t.tensors for t in e.transfers)
    lines = [
        f"bytes crossing devices per step: {size(e.bytes_crossing)} in {count} tensors",
        f"  {'from':<16} {'to':<16} {'what':<20} {'made in -> used in':<36} "
        f"{'tensors':>7} {'bytes':>10}",
    ]
    for t in sorted(e.transfers, key=lambda t: (t.source, t.target, t.kind)):
        stages = f"{t.source_stage} -> {t.target_stage}"
        lines.append(
            f"  {t.source:<16} {t.target:<16} {t.kind:<20} {stages:<36} "
            f"{t.tensors:>7} {t.bytes:>10}"
        )
    if e.unknown_bytes:
        lines.append(
            f"  (and {e.unknown_bytes} tensors whose size is known only at run time)"
        )
    return lines


def size(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``.

    >>> size(512), size(1536), size(3 * 2**20)
    ('512 B', '1.5 KiB', '3.0 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def short(device: str) -> str:
    return device.replace("/device:", "")


def row_of(stage: str) -> str:
    """The diagram row of a stage: ``"tower 2 forward"`` -> ``"forward"``."""
    tower = re.fullmatch(r"tower \d+ (forward|XLA|backward)", stage)
    if tower:
        return tower.group(1)
    return stage if stage in ROWS else "metrics"

"""The report of ``towers explain``: a text table and a diagram (devices as columns,
the step's stages as rows, the tensors that crossed devices as arrows)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

# Rows of the diagram, in data-path order; a tower's forward and backward passes
# share the "forward", "XLA" and "backward" rows.
_ROWS = (
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
        else:  # a pass cut where the towers meet (towers/step/segments.py)
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
    return stage if stage in _ROWS else "metrics"


def draw(explanation: Any, path: str) -> None:
    """Writes the diagram of ``explanation`` to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    except ImportError as error:
        raise RuntimeError(
            "--png needs matplotlib; install it with pip install 'towers[bench]'"
        ) from error
    e = explanation
    columns = list(e.all_devices)
    if any(t.target == "collective group" for t in e.transfers):
        columns.append("collective group")
    boxes = _boxes(e)
    rows = [r for r in _ROWS if any(key[0] == r for key in boxes)]
    x_of = {d: i * 3.4 for i, d in enumerate(columns)}
    y_of = {r: -i * 1.6 for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(3.0 * len(columns) + 2.0, 1.25 * len(rows) + 1.5))
    for device, x in x_of.items():
        ax.text(x, 1.1, short(device), ha="center", fontsize=11, weight="bold")
        ax.plot([x, x], [0.8, y_of[rows[-1]] - 0.7], color="0.85", zorder=0)
    for row, y in y_of.items():
        ax.text(-2.0, y, row, ha="right", va="center", fontsize=10, style="italic")
    patches = {}
    for (row, device), label in boxes.items():
        x, y = x_of[device], y_of[row]
        patches[(row, device)] = ax.add_patch(
            FancyBboxPatch(
                (x - 1.3, y - 0.5),
                2.6,
                1.0,
                boxstyle="round,pad=0.05",
                facecolor=_COLOURS.get(row, "#eeeeee"),
                edgecolor="0.3",
                zorder=2,
            )
        )
        ax.text(x, y, label, ha="center", va="center", fontsize=7.5, zorder=3)
    arrows = _arrows(e, boxes)
    fan_out = Counter(src for src, _ in arrows)
    for (src, dst), (kind, nbytes) in arrows.items():
        start = (x_of[src[1]], y_of[src[0]])
        end = (x_of[dst[1]], y_of[dst[0]])
        minor = kind == "outputs"
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                patchA=patches[src],
                patchB=patches[dst],
                arrowstyle="-|>",
                mutation_scale=10 if minor else 14,
                color="0.6" if minor else _ARROW_COLOURS.get(kind, "#3060a0"),
                linewidth=0.8 if minor else 1.4,
                zorder=1,
            )
        )
        if minor:
            continue
        # Labels sit near the end that differs between arrows, so they don't pile.
        f = 0.72 if fan_out[src] > 1 else 0.28
        at = (start[0] + f * (end[0] - start[0]), start[1] + f * (end[1] - start[1]))
        ax.text(
            *at,
            f"{kind}\n{size(nbytes)}",
            fontsize=7,
            ha="center",
            va="center",
            color=_ARROW_COLOURS.get(kind, "#3060a0"),
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.8},
            zorder=4,
        )
    ax.set_xlim(-3.6, x_of[columns[-1]] + 1.6)
    ax.set_ylim(y_of[rows[-1]] - 0.9, 1.6)
    ax.axis("off")
    ax.set_title(
        f"one step of {sum(e.sizes)} examples on {len(e.devices)} towers "
        f"(placement {e.placement!r}); arrows: bytes crossing devices "
        f"({size(e.bytes_crossing)} per step)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_ARROW_COLOURS = {
    "batch": "#555555",
    "weights": "#a06010",
    "gradients": "#2f7a2f",
    "combined gradients": "#3060a0",
}

_COLOURS = {
    "variables": "#f6e3b4",
    "split": "#dddddd",
    "forward": "#cfe5cf",
    "XLA": "#c2dfc2",
    "backward": "#b5d8b5",
    "combine": "#c9d8ef",
    "across workers": "#c9d8ef",
    "apply": "#f3c9c0",
    "metrics": "#eeeeee",
}


def _boxes(e: Any) -> dict[tuple[str, str], str]:
    """(row, device) -> the box's label."""
    lines: dict[tuple[str, str], list[str]] = defaultdict(list)
    held: dict[str, list] = defaultdict(list)
    for var in e.variables:
        held[var.device].append(var)
    for device, variables in held.items():
        total = sum(v.bytes for v in variables)
        lines[("variables", device)].append(
            f"{len(variables)} variables, {size(total)}"
        )
    for stage, counts in e.ops.items():
        if stage == "other":
            continue
        for device, count in counts.items():
            who = stage.rsplit(" ", 1)[0] if stage.startswith("tower ") else stage
            lines[(row_of(stage), device)].append(f"{who}: {count} ops")
    for t in e.transfers:
        if t.target == "collective group":
            lines[("combine", t.target)] = [f"{t.kind}\nacross the group"]
    return {key: "\n".join(_fold(text)) for key, text in lines.items()}


def _fold(lines: list[str], most: int = 4) -> list[str]:
    """At most ``most`` lines, the last saying how many were left out."""
    if len(lines) <= most:
        return lines
    return [*lines[: most - 1], f"+{len(lines) - most + 1} more"]


def _arrows(e: Any, boxes: dict) -> dict[tuple, tuple[str, int]]:
    """(source box, target box) -> (kind, bytes per step), for boxes that exist;
    kinds that share an arrow are named by the one with most bytes."""
    arrows: dict[tuple, Counter] = defaultdict(Counter)
    for t in e.transfers:
        source_row = "variables" if t.kind == "weights" else row_of(t.source_stage)
        target_row = (
            "combine" if t.target == "collective group" else row_of(t.target_stage)
        )
        src, dst = (source_row, t.source), (target_row, t.target)
        if src in boxes and dst in boxes and src != dst:
            arrows[(src, dst)][t.kind] += t.bytes
    return {
        key: (kinds.most_common(1)[0][0], sum(kinds.values()))
        for key, kinds in arrows.items()
    }

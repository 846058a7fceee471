"""The picture of ``towers explain --png``: devices as columns, the step's
stages as rows, the tensors that crossed devices as arrows.

Drawn as a wiring diagram, so it stays readable at 8 towers and under every
placement: an arrow leaves a box's bottom, runs along its kind's own track in
the gap below the row (a bus every arrow of that kind shares), goes down the
lane between columns where it skips rows, and drops into its box. No arrow
crosses a box it does not start or end at, and no label sits on an arrow:
each box says what came into it, by kind, with the bytes and from how many
devices. :func:`layout` places everything (what the tests check);
:func:`draw` paints it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

from towers.explain.report import ROWS, row_of, short, size

# Arrows a student follows (thick, and listed in the box they enter) and the
# small ones beside them (thin).
ARROW_COLOURS = {
    "batch": "#555555",
    "weights": "#a06010",
    "gradients": "#2f7a2f",
    "combined gradients": "#3060a0",
    "all-reduce": "#3060a0",
    "loss": "#7a7a7a",
    "predictions": "#7a7a7a",
    "updates": "#b05050",
    "outputs": "#7a7a7a",
}
_MINOR = {"loss", "predictions", "outputs"}
_BOX_COLOURS = {
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
# Layout units: a column's pitch and a box's width; a text line's height.
PITCH, WIDTH, LINE = 3.6, 2.8, 0.19
GAP = 0.9  # between rows: the tracks of every kind run here


@dataclasses.dataclass
class Box:
    row: str
    device: str
    x: float  # centre
    top: float
    bottom: float
    lines: list[tuple[str, str]]  # (text, colour)

    def holds(self, x: float, y: float) -> bool:
        """Whether (x, y) is inside the box, its edge not included."""
        return abs(x - self.x) < WIDTH / 2 - 1e-9 and self.bottom < y < self.top


@dataclasses.dataclass
class Arrow:
    kind: str
    points: list[tuple[float, float]]  # a polyline, its head at the last point
    source: tuple[str, str]
    target: tuple[str, str]


@dataclasses.dataclass
class Layout:
    boxes: dict[tuple[str, str], Box]
    arrows: list[Arrow]
    columns: list[str]
    rows: list[str]
    height: float


def layout(e: Any) -> Layout:
    """Every box and arrow of ``e``'s picture (an ``Explanation``), placed."""
    columns = list(e.all_devices)
    if any(t.target == "collective group" for t in e.transfers):
        columns.append("collective group")
    crossings = _crossings(e)
    labels = _labels(e)
    into: dict[tuple, dict[str, tuple[int, set]]] = defaultdict(dict)
    for (src, dst, kind), nbytes in crossings.items():
        total, sources = into[dst].get(kind, (0, set()))
        into[dst][kind] = (total + nbytes, sources | {src[1]})
    for dst, kinds in into.items():
        for kind, (nbytes, sources) in sorted(kinds.items(), key=lambda k: -k[1][0]):
            many = f" from {len(sources)}" if len(sources) > 1 else ""
            labels.setdefault(dst, []).append(
                (f"<- {kind} {size(nbytes)}{many}", ARROW_COLOURS.get(kind, "#3060a0"))
            )
    rows = [r for r in ROWS if any(key[0] == r for key in labels)]
    x_of = {d: i * PITCH for i, d in enumerate(columns)}
    boxes, top = {}, 0.0
    for row in rows:
        tall = max(len(v) for k, v in labels.items() if k[0] == row) * LINE + 0.3
        for (r, device), lines in labels.items():
            if r == row:
                boxes[(r, device)] = Box(
                    r, device, x_of[device], top, top - tall, lines
                )
        top -= tall + GAP
    top += GAP  # the last row's bottom
    kinds = sorted({kind for _, _, kind in crossings}, key=list(ARROW_COLOURS).index)
    row_bottom = {b.row: b.bottom for b in boxes.values()}
    row_top = {b.row: b.top for b in boxes.values()}
    arrows = [
        Arrow(
            kind,
            _route(
                src, dst, kinds.index(kind), len(kinds), x_of, rows, row_top, row_bottom
            ),
            src,
            dst,
        )
        for (src, dst, kind) in crossings
    ]
    return Layout(boxes, arrows, columns, rows, -top)


def _route(src, dst, k, count, x_of, rows, row_top, row_bottom):
    """The polyline from box ``src`` to box ``dst`` for the ``k``-th of
    ``count`` kinds: down into the gap below ``src``'s row along its track,
    down the lane right of ``dst``'s column past the rows between, along the
    gap above (below, going up) ``dst``'s row, into it."""
    share = (k + 1) / (count + 1)
    track = lambda row: row_bottom[row] - GAP * share  # noqa: E731 - gap below row
    xs = x_of[src[1]] + WIDTH * (share - 0.5) * 0.8
    xd = x_of[dst[1]] + WIDTH * (share - 0.5) * 0.8
    a, b = rows.index(src[0]), rows.index(dst[0])
    start = [(xs, row_bottom[src[0]]), (xs, track(src[0]))]
    if b == a + 1:
        return [*start, (xd, track(src[0])), (xd, row_top[dst[0]])]
    if b == a:
        return [*start, (xd, track(src[0])), (xd, row_bottom[dst[0]])]
    lane = x_of[dst[1]] + WIDTH / 2 + (PITCH - WIDTH) * share
    if b > a:  # down the lane to the gap above dst's row
        gap = track(rows[b - 1])
        return [
            *start,
            (lane, start[1][1]),
            (lane, gap),
            (xd, gap),
            (xd, row_top[dst[0]]),
        ]
    gap = track(dst[0])  # up the lane to the gap below dst's row
    return [
        *start,
        (lane, start[1][1]),
        (lane, gap),
        (xd, gap),
        (xd, row_bottom[dst[0]]),
    ]


def _crossings(e: Any) -> dict[tuple, int]:
    """(source box, target box, kind) -> bytes per step."""
    found: Counter = Counter()
    for t in e.transfers:
        source = "variables" if t.kind == "weights" else row_of(t.source_stage)
        target = "combine" if t.target == "collective group" else row_of(t.target_stage)
        src, dst = (source, t.source), (target, t.target)
        if src != dst:
            found[(src, dst, t.kind)] += t.bytes
    return dict(found)


def _labels(e: Any) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(row, device) -> the box's lines: what it holds or ran. A tower's pass
    on another tower's device is its reads of the variables living there."""
    lines: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    held: dict[str, list] = defaultdict(list)
    for var in e.variables:
        held[var.device].append(var)
    for device, variables in held.items():
        total = size(sum(v.bytes for v in variables))
        lines[("variables", device)].append(
            (f"{len(variables)} variables, {total}", "black")
        )
    reads: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for stage, counts in e.ops.items():
        if stage == "other":
            continue
        row, tower = row_of(stage), None
        if stage.startswith("tower "):
            tower = int(stage.split()[1])
        for device, count in counts.items():
            if tower is not None and e.devices[tower] != device:
                reads[(row, device)][tower] += count
                continue
            who = stage if tower is None else f"tower {tower}"
            lines[(row, device)].append((f"{who}: {count} ops", "black"))
    for key, towers in reads.items():
        lines[key].append(
            (
                f"reads for {len(towers)} other tower{'s' * (len(towers) > 1)}: "
                f"{sum(towers.values())} ops",
                "black",
            )
        )
    for t in e.transfers:
        if t.target == "collective group":
            lines[("combine", t.target)] = [(f"{t.kind} across the group", "black")]
    return dict(lines)


def draw(e: Any, path: str) -> None:
    """Writes ``e``'s picture to ``path`` (PNG)."""
    fig, _, _ = figure(e)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure(e: Any) -> tuple[Any, Layout, dict[tuple[str, str], tuple[Any, list]]]:
    """``e``'s picture as a matplotlib figure, its :class:`Layout`, and each
    box's patch and text artists (what a test measures)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
        from matplotlib.path import Path
    except ImportError as error:
        raise RuntimeError(
            "--png needs matplotlib; install it with pip install 'towers[bench]'"
        ) from error
    placed = layout(e)
    right = (len(placed.columns) - 1) * PITCH + WIDTH / 2 + 0.9
    scale = 0.8  # inches per unit
    fig, ax = plt.subplots(
        figsize=((right + WIDTH / 2 + 3.2) * scale, (placed.height + 1.3) * scale)
    )
    for device in placed.columns:
        x = placed.columns.index(device) * PITCH
        ax.text(x, 0.45, short(device), ha="center", fontsize=11, weight="bold")
    for row in placed.rows:
        box = next(b for b in placed.boxes.values() if b.row == row)
        ax.text(
            -WIDTH / 2 - 0.4,
            (box.top + box.bottom) / 2,
            row,
            ha="right",
            va="center",
            fontsize=10,
            style="italic",
        )
    drawn = {}
    for key, box in placed.boxes.items():
        patch = ax.add_patch(
            FancyBboxPatch(
                (box.x - WIDTH / 2, box.bottom),
                WIDTH,
                box.top - box.bottom,
                boxstyle="round,pad=0.02",
                facecolor=_BOX_COLOURS.get(box.row, "#eeeeee"),
                edgecolor="0.3",
                zorder=2,
            )
        )
        first = (box.top + box.bottom) / 2 + (len(box.lines) - 1) * LINE / 2
        texts = [
            ax.text(
                box.x,
                first - i * LINE,
                text,
                ha="center",
                va="center",
                fontsize=7.5,
                color=colour,
                zorder=3,
            )  # fmt: skip
            for i, (text, colour) in enumerate(box.lines)
        ]
        drawn[key] = (patch, texts)
    for arrow in placed.arrows:
        minor = arrow.kind in _MINOR
        ax.add_patch(
            FancyArrowPatch(
                path=Path(arrow.points),
                arrowstyle="-|>",
                mutation_scale=8 if minor else 11,
                color=ARROW_COLOURS.get(arrow.kind, "#3060a0"),
                linewidth=0.7 if minor else 1.2,
                zorder=1,
            )
        )
    ax.set_xlim(-WIDTH / 2 - 3.2, right)
    ax.set_ylim(-placed.height - 0.2, 1.0)
    ax.axis("off")
    ax.set_title(
        f"one step of {sum(e.sizes)} examples on {len(e.devices)} "
        f"tower{'s' * (len(e.devices) > 1)} (placement {e.placement!r})\n"
        + (
            f"{size(e.bytes_crossing)} crossed devices; each box lists what came "
            "into it (<-)"
            if e.transfers
            else "nothing crossed devices"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    return fig, placed, drawn

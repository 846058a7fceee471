"""``towers bench`` output: a table, a JSON file, and a plot."""

from __future__ import annotations

import json
from typing import Any

from towers.bench.run import label

_MB = 1e6


# The step table's columns: (header, the record's cell). A column no row
# fills (vs 1 dev xla without --xla; vs floor at one tower) is left out.
_STEP = [
    ("step ms", lambda r, p: f"{r['step_ms']:.2f}"),
    ("1 dev ms", lambda r, p: f"{r['single_device_ms']:.2f}"),
    ("vs 1 dev", lambda r, p: _maybe_spread(r, "vs_single_device")),
    ("vs 1 dev xla", lambda r, p: _maybe_spread(r, "vs_single_device_xla")),
    ("vs floor", lambda r, p: _maybe_spread(r, "vs_floor")),
    ("ex/s", lambda r, p: f"{r['examples_per_second']:.0f}"),
    ("speedup", lambda r, p: _maybe(r.get("speedup"), "{:.2f}")),
    ("eff", lambda r, p: _maybe(r.get("efficiency"), "{:.0%}")),
]
# The towers rows' phases, bytes and bandwidths.
_PHASES = [
    ("fwd+bwd ms", lambda r, p: _maybe(p.get("compute"), "{:.2f}")),
    ("combine ms", lambda r, p: _maybe(p.get("combine"), "{:.2f}")),
    ("apply ms", lambda r, p: _maybe(p.get("apply"), "{:.2f}")),
    ("MB/tower", lambda r, p: _maybe(r.get("bytes_per_tower"), "{:.2f}", _MB)),
    ("algbw GB/s", lambda r, p: _maybe(r.get("algbw_gbps"), "{:.2f}")),
    ("busbw GB/s", lambda r, p: _maybe(r.get("busbw_gbps"), "{:.2f}")),
]
_LEGEND = {
    "1 dev ms": "the plain single-device step on the same T x batch examples, "
    "timed in the same process, in turns with the row's step",
    "vs 1 dev": "step ms / 1 dev ms, paired round by round [quartiles]: what "
    "splitting this batch costs here (under 1: it pays); single's own is the "
    "noise of this machine",
    "vs 1 dev xla": "the same against the single-device step compiled with XLA",
    "vs floor": "against the zero-sync floor (the same shards, a model copy per "
    "device, nothing combined): what the sync costs",
    "speedup": "examples/s over the same contender's at 1 tower, which takes "
    "1/T of the examples (--batch is per tower); eff = speedup / T. So it can "
    "disagree with vs 1 dev, which keeps the examples",
    "fwd+bwd ms": "the towers' phases (forward+backward, combine, apply), each "
    "timed alone as its own compiled function: they overlap within the step",
    "algbw GB/s": "MB/tower over the combine's time; busbw = algbw x 2(T-1)/T "
    "(nccl-tests' conventions; the topology that ran is said below)",
}


def tables(result: dict[str, Any], width: int = 100) -> list[str]:
    """Lines no wider than ``width``: every row's step and ratios, then the
    towers rows' phases and bandwidths, a column no row fills left out. Where
    the columns do not fit, the rest follow under the same rows.

    >>> lines = tables({"preset": "mlp", "batch": 8, "device_note": "2 CPUs",
    ...     "records": [{"contender": "naive", "towers": 2, "status": "failed"}]})
    >>> lines[1:4]
    ['contender  T', '------------', 'naive      2']
    """
    records = result["records"]
    ok = [r for r in records if r["status"] == "ok"]
    towers = [r for r in ok if "phases_ms" in r]
    lines = _grid(_title(result), _STEP, records, ok, width)
    if towers:
        lines += _grid("the towers' phases", _PHASES, towers, towers, width)
    return lines


def legend(result: dict[str, Any], width: int = 100) -> list[str]:
    """What each ratio and column of :func:`tables` is against, for the
    columns shown; then each row not measured, and why."""
    records = result["records"]
    ok = [r for r in records if r["status"] == "ok"]
    shown = {name for name, cell in _STEP + _PHASES if _filled(cell, ok)}
    said = [f"{name}: {text}" for name, text in _LEGEND.items() if name in shown]
    said += [
        f"{label(r)} x{r['towers']}: {r['status']}" for r in records if r not in ok
    ]
    return [line for text in said for line in _wrapped(text, width)]


def _grid(title: str, columns: list, records: list, ok: list, width: int) -> list:
    shown = [(name, cell) for name, cell in columns if _filled(cell, ok)]
    names = ["contender", "T", *(name for name, _ in shown)]
    rows = [
        [label(r), str(r["towers"])]
        + [cell(r, r.get("phases_ms", {})) if r in ok else "-" for _, cell in shown]
        for r in records
    ]
    wide = [max(len(n), *(len(row[i]) for row in rows)) for i, n in enumerate(names)]
    lines = _wrapped(title, width)
    for band in _bands([w + 2 for w in wide], width):
        picked = [0, 1, *band]
        drawn = [
            "  ".join(
                cells[j].ljust(wide[j]) if j == 0 else cells[j].rjust(wide[j])
                for j in picked
            )
            for cells in [names, *rows]
        ]
        lines += [drawn[0], "-" * len(drawn[0]), *drawn[1:], ""]
    return lines


def _bands(wide: list[int], width: int) -> list[list[int]]:
    """The columns after contender and T (``wide``: each one's width), in as
    few bands as fit ``width``, as even as fit: no lone column at the end."""
    rest = list(range(2, len(wide)))
    for count in range(1, max(len(rest), 1) + 1):
        sizes = [len(rest) // count + (i < len(rest) % count) for i in range(count)]
        starts = [sum(sizes[:i]) for i in range(count)]
        bands = [rest[a : a + n] for a, n in zip(starts, sizes)]
        if all(sum(wide[j] for j in (0, 1, *band)) <= width for band in bands):
            return bands
    return [[j] for j in rest]


def _wrapped(text: str, width: int) -> list[str]:
    import textwrap

    wrapped = textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)
    return wrapped or [""]


def _filled(cell: Any, records: list) -> bool:
    return any(cell(r, r.get("phases_ms", {})) not in ("", "-") for r in records)


def placements(result: dict[str, Any], width: int = 100) -> list[str]:
    """Per towers configuration its topology and variable bytes by device,
    wrapped at ``width``."""
    lines = []
    for record in result["records"]:
        if record["status"] == "ok" and "topology" in record:
            where = ", ".join(
                f"{_short(device)} {nbytes / _MB:.2f} MB"
                for device, nbytes in record["variables_by_device"].items()
            )
            lines += _wrapped(
                f"{label(record)} x{record['towers']}: {record['topology']}; "
                f"variables: {where}",
                width,
            )
    return lines


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")


def plot(result: dict[str, Any], path: str) -> None:
    """Step time and scaling efficiency against towers, one line per contender."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError(
            "--plot needs matplotlib; install it with pip install 'towers[bench]'"
        ) from error
    lines: dict[str, list[dict]] = {}
    for record in result["records"]:
        if record["status"] == "ok":
            lines.setdefault(label(record), []).append(record)
    figure, (step_axis, eff_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, records in lines.items():
        records.sort(key=lambda r: r["towers"])
        towers = [r["towers"] for r in records]
        step_axis.plot(towers, [r["step_ms"] for r in records], "o-", label=name)
        eff_axis.plot(
            towers, [100 * r.get("efficiency", 0) for r in records], "o-", label=name
        )
    step_axis.set(xlabel="towers", ylabel="step time (ms)", title="Step time")
    eff_axis.set(
        xlabel="towers", ylabel="scaling efficiency (%)", title="Efficiency vs 1 tower"
    )
    counts = sorted({r["towers"] for r in result["records"]})
    for axis in (step_axis, eff_axis):
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(c) for c in counts])
        axis.grid(True, alpha=0.3)
    eff_axis.legend(fontsize=8)
    figure.suptitle(_title(result), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _title(result: dict[str, Any]) -> str:
    return (
        f"towers bench: preset {result['preset']}, batch {result['batch']} per "
        f"tower, devices {result['device_note']}"
    )


def _spread(record: dict[str, Any], name: str) -> str:
    """A ratio with its rounds' quartiles: ``1.05 [1.01-1.09]``."""
    return (
        f"{record[name]:.2f} [{record[name + '_q25']:.2f}-{record[name + '_q75']:.2f}]"
    )


def _maybe_spread(record: dict[str, Any], name: str) -> str:
    return _spread(record, name) if name in record else "-"


def _maybe(value: Any, form: str, scale: float = 1.0) -> str:
    return "" if value is None else form.format(value / scale)


def _short(device: str) -> str:
    return device.rsplit("device:", 1)[-1]

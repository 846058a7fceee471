"""``towers bench`` output: a table, a JSON file, and a plot."""

from __future__ import annotations

import json
from typing import Any

from towers.bench.run import label

_MB = 1e6


def table(result: dict[str, Any]) -> Any:
    """A rich Table, one row per configuration."""
    from rich.table import Table

    grid = Table(title=_title(result), title_justify="left")
    for name in [
        "contender", "T", "step ms", "vs 1 dev", "vs 1 dev xla", "vs floor", "ex/s",
        "speedup", "eff",
        "fwd+bwd ms", "combine ms", "apply ms", "MB/tower", "algbw GB/s",
        "busbw GB/s",
    ]:  # fmt: skip
        grid.add_column(name, justify="left" if name == "contender" else "right")
    for record in result["records"]:
        if record["status"] != "ok":
            grid.add_row(label(record), str(record["towers"]), record["status"])
            continue
        phases = record.get("phases_ms", {})
        grid.add_row(
            label(record),
            str(record["towers"]),
            f"{record['step_ms']:.2f}",
            _spread(record, "vs_single_device"),
            _maybe_spread(record, "vs_single_device_xla"),
            _maybe_spread(record, "vs_floor"),
            f"{record['examples_per_second']:.0f}",
            _maybe(record.get("speedup"), "{:.2f}"),
            _maybe(record.get("efficiency"), "{:.0%}"),
            _maybe(phases.get("compute"), "{:.2f}"),
            _maybe(phases.get("combine"), "{:.2f}"),
            _maybe(phases.get("apply"), "{:.2f}"),
            _maybe(record.get("bytes_per_tower"), "{:.2f}", scale=_MB),
            _maybe(record.get("algbw_gbps"), "{:.2f}"),
            _maybe(record.get("busbw_gbps"), "{:.2f}"),
        )
    return grid


def placements(result: dict[str, Any]) -> list[str]:
    """One line per towers configuration: its topology and variable bytes by device."""
    lines = []
    for record in result["records"]:
        if record["status"] == "ok" and "topology" in record:
            where = ", ".join(
                f"{_short(device)} {nbytes / _MB:.2f} MB"
                for device, nbytes in record["variables_by_device"].items()
            )
            lines.append(
                f"{label(record)} x{record['towers']}: {record['topology']}; "
                f"variables: {where}"
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

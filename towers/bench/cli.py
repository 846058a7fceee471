"""``towers bench`` from parsed arguments: check them, run, report, write files."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

from towers.bench.run import BASELINES, PLACEMENTS, BenchOptions, choose_devices


def run(args: argparse.Namespace) -> int:
    """Runs the bench; returns the exit status (0 ok, 1 a configuration failed,
    3 --max-seconds stopped it). Bad flags raise ValueError before anything runs."""
    if args.predict:
        from towers.bench.predict import print_prediction

        print_prediction(
            _preset_bytes(args.preset), args.compute_ms, args.batch, args.towers
        )
        return 0
    if args.workers:
        return _run_workers(args)
    options = _options(args)
    import tensorflow as tf

    devices, virtual, note = choose_devices(
        max(options.towers), len(tf.config.list_physical_devices("GPU")), args.virtual
    )
    result = _measure(options, devices, virtual, note)
    _report(result, args)
    failed = [r for r in result["records"] if r["status"].startswith("failed")]
    if result["timed_out"]:
        print(
            f"towers bench: stopped at --max-seconds {args.max_seconds:g}: "
            f"{_count(result, 'ok')} of {len(result['records'])} configurations "
            "finished; the rest are marked in the table and the files.",
            file=sys.stderr,
        )
        return 3
    return 1 if failed else 0


def _run_workers(args: argparse.Namespace) -> int:
    """--workers W: W local worker processes vs one process, ratio in the chief."""
    import json

    from towers.bench.workers import describe, run_workers

    record = run_workers(
        args.preset, args.workers, args.towers_per_worker, args.batch, args.steps
    )
    print(describe(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def _options(args: argparse.Namespace) -> BenchOptions:
    from towers.reducers import get_reducer

    for reducer in args.reducer:
        get_reducer(reducer)  # raises with the valid names
    for placement in args.placement:
        if placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement; received {placement!r}, expected one of "
                f"{list(PLACEMENTS)}"
            )
    baselines = [] if args.baselines == ["none"] else args.baselines
    for baseline in baselines:
        if baseline not in BASELINES:
            raise ValueError(
                f"unknown baseline; received {baseline!r}, expected some of "
                f"{list(BASELINES)} or none"
            )
    return BenchOptions(
        preset=args.preset,
        towers=sorted(set(args.towers)),
        reducers=args.reducer,
        placements=args.placement,
        batch=args.batch,
        steps=args.steps,
        baselines=baselines,
        max_seconds=args.max_seconds,
    )


def _measure(options, devices, virtual, note) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from towers.bench.run import run_bench

    progress = Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
    )
    with progress:
        task = progress.add_task("starting", total=None)

        def on_progress(done: int, total: int, name: str) -> None:
            progress.update(task, completed=done, total=total, description=name)

        result = run_bench(options, devices, virtual, on_progress)
    import tensorflow as tf

    return {
        "preset": options.preset,
        "batch": options.batch,
        "steps": options.steps,
        "devices": devices,
        "device_note": note,
        "tensorflow": tf.__version__,
        "machine": platform.platform(),
        **result,
    }


def _report(result: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console

    from towers.bench import report

    console = Console(width=160)
    console.print(report.table(result))
    for line in report.placements(result):
        console.print(line, highlight=False)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")


def _preset_bytes(name: str) -> float:
    """Bytes of the preset's trainable variables (its dense gradient size)."""
    from towers.bench.presets import get_preset
    from towers.placement import variable_bytes

    model = get_preset(name).build()
    return float(sum(variable_bytes(v) for v in model.trainable_variables))


def _count(result: dict[str, Any], status: str) -> int:
    return sum(r["status"] == status for r in result["records"])

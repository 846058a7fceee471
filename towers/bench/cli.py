"""``towers bench``: its arguments, and from them a run, a report and files.

Only light modules load here: every ``towers`` command builds the whole parser.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

from towers.bench.run import (
    BASELINES,
    PLACEMENTS,
    PRESET_NAMES,
    BenchOptions,
    choose_devices,
)
from towers.commands import int_list, name_list, positive_float, positive_int

BENCH_HELP = """\
Measure what gradient synchronisation costs. Each configuration (tower count x
placement x reducer) and each baseline runs in a fresh process, timed in turns,
round by round, with the plain single-device step and the zero-sync floor (the
same shards, a model copy per device, nothing combined) on the same batch. The
table's legend says what each ratio is against; docs/sync-cost.md has the
method and the cost model behind --predict.
"""


def add_bench_parser(commands: Any) -> None:
    """Adds ``towers bench`` to the ``towers`` command's sub-parsers."""
    bench = commands.add_parser(
        "bench",
        help="measure gradient-sync cost: towers vs single device and tf.distribute",
        description=BENCH_HELP,
    )
    what = bench.add_argument_group("what to measure")
    what.add_argument(
        "--preset", choices=PRESET_NAMES, default="mlp", help="model (default: mlp)"
    )
    what.add_argument(
        "--towers",
        type=int_list,
        default=[1, 2, 4],
        metavar="LIST",
        help="tower counts, comma-separated (default: 1,2,4)",
    )
    what.add_argument(
        "--placement",
        type=name_list,
        default=["cpu"],
        metavar="LIST",
        help=f"variable placements, comma-separated: {', '.join(PLACEMENTS)} "
        "(default: cpu)",
    )
    what.add_argument(
        "--reducer",
        type=name_list,
        default=["per_tensor"],
        metavar="LIST",
        help="reducers, comma-separated: per_tensor, packed, sharded, cast, or "
        "bf16+/fp16+ before one (default: per_tensor)",
    )
    what.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help="examples per tower: T towers take T x BATCH, as in "
        "tf_cnn_benchmarks (default: 64)",
    )
    what.add_argument(
        "--steps",
        type=positive_int,
        default=50,
        help="timed steps per contender (default: 50)",
    )
    what.add_argument(
        "--xla",
        action="store_true",
        help="also each towers configuration and the single-device step compiled "
        "with XLA (jit_compile=True), beside their twins without (the strategies "
        "have none: Keras turns XLA off under tf.distribute)",
    )
    peers = bench.add_argument_group("against what")
    peers.add_argument(
        "--baselines",
        type=name_list,
        default=list(BASELINES),
        metavar="LIST",
        help="comma-separated, or none: single (the plain single-device step; "
        "its ratio to itself is the noise floor), naive (the TF1 tutorials' "
        "average_gradients on the CPU), mirrored (MirroredStrategy), "
        f"central_storage (CentralStorageStrategy) (default: {','.join(BASELINES)})",
    )
    peers.add_argument(
        "--virtual",
        action="store_true",
        help="split one device into logical devices even where GPUs exist (without "
        "GPUs the CPU is split anyway; more towers than GPUs needs it)",
    )
    workers = bench.add_argument_group(
        "several workers (docs/multi-worker.md)",
        "The preset as W worker processes on loopback, TensorFlow's collective "
        "runtime between them, against its CPU floor (every worker's CPU per step, "
        "summed over the shared cores), one process with W x T towers, and "
        "MultiWorkerMirroredStrategy in the same processes (--baselines none skips "
        "it; with T > 1 it does not run).",
    )
    workers.add_argument(
        "--workers", type=positive_int, metavar="W", help="local worker processes"
    )
    workers.add_argument(
        "--towers-per-worker",
        type=positive_int,
        default=1,
        metavar="T",
        help="towers in each worker (default: 1)",
    )
    output = bench.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="write every record as JSON")
    output.add_argument(
        "--plot", metavar="FILE.png", help="plot step time and efficiency vs towers"
    )
    output.add_argument(
        "--max-seconds",
        type=positive_float,
        metavar="S",
        help="stop starting configurations after S seconds; what finished is "
        "still reported and written",
    )
    projected = bench.add_argument_group("projecting instead of measuring")
    projected.add_argument(
        "--predict",
        action="store_true",
        help="project step time and efficiency on GPU topologies from link "
        "bandwidth, compute time and model size",
    )
    projected.add_argument(
        "--compute-ms",
        type=positive_float,
        metavar="MS",
        help="one tower's forward + backward time on the target device",
    )
    bench.set_defaults(run=run)


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

    peers = [] if args.baselines == ["none"] else ["mwms"]
    record = run_workers(
        args.preset,
        args.workers,
        args.towers_per_worker,
        args.batch,
        args.steps,
        peers=peers,
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
        xla=args.xla,
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
    import shutil

    from towers.bench import report

    width = shutil.get_terminal_size((100, 24)).columns  # COLUMNS, else 100
    lines = report.tables(result, width) + report.legend(result, width)
    print("\n".join(lines + report.placements(result, width)))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")


def _preset_bytes(name: str) -> float:
    """Bytes of the preset's trainable variables (its dense gradient size)."""
    from towers.bench.presets import get_preset
    from towers.placement.base import variable_bytes

    model = get_preset(name).build()
    return float(sum(variable_bytes(v) for v in model.trainable_variables))


def _count(result: dict[str, Any], status: str) -> int:
    return sum(r["status"] == status for r in result["records"])

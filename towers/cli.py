"""The ``towers`` command.

Each command imports TensorFlow only when it runs, and splits devices first: logical
devices can only be made before TensorFlow initialises.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from towers.bench.cli import add_bench_parser
from towers.cluster.launch import GRACE_SECONDS
from towers.commands import positive_float, positive_int, start_tensorflow

DESCRIPTION = """\
towers: data-parallel training with towers on TensorFlow 2.

A tower is one device's share of a training step. towers keeps the model's
variables on one variable device, runs each tower's forward and backward pass on
its own device, combines the gradients and applies them once per step.
"""

DEVICES_HELP = """\
List the devices TensorFlow sees: physical devices (the hardware) and logical
devices (what towers can place work on). With --virtual N the first CPU (or GPU,
with --kind GPU) is split into N logical devices first, as towers.virtual_devices(N)
does in a script, so you can see the names your towers would get.
"""

DEMO_HELP = """\
Train a small convolutional network on scikit-learn's bundled handwritten digits
(no download) with N towers, then print the test accuracy, where every variable
and each tower's work lived, and what one step costs phase by phase (towers'
forward + backward, combine, apply). Uses N GPUs if there are, else the CPU split
into N logical devices.
"""

EXPLAIN_HELP = """\
Show where one training step of the demo's model (the digits CNN) put every
variable and op, as TensorFlow placed them: the step is traced afresh and run
once on a batch of the bundled digits while TensorFlow records the graphs it
partitioned per device. The report lists every variable (name, shape, bytes,
device), each tower's forward and backward ops counted by device, where the
combine and the apply ran, and the tensors that crossed devices with their
bytes. --png draws it: devices as columns, the step's stages as rows, the data
path as arrows. --check then runs the same step against the model's own
train_step on one device, on the same batch from the same variables, and
prints every variable's relative difference (each put back after). Python:
towers.Towers(...).explain(x, y) and .check(x, y).
"""


LAUNCH_HELP = """\
Start N worker processes of one command on this machine, each with a TF_CONFIG
naming the cluster (every worker's 127.0.0.1:port, ports free when chosen) and
its own index, as a job across machines would give them. Every output line is
prefixed with its worker. If any worker fails, the others are stopped and the
launcher exits with that worker's status. SIGTERM or SIGINT (Ctrl-C) to the
launcher goes on to every worker as SIGTERM: in fit they stop after the same
step, the chief saves, and the launcher exits with their status (75) once they
have, killing any still running after --grace seconds; a second signal kills
them at once. Workers whose launcher was killed stop the same way. TensorFlow's
servers listen on every interface of their ports, so by default the workers
share a private network namespace whose only interface is its loopback: nothing
outside the job can reach them (where the kernel refuses one, the launcher says
so and uses the machine's network). --network host gives them the machine's
network.

Example: towers launch --workers 2 -- python train.py --epochs 3
"""


def _version() -> str:
    """The installed tf-towers' version, else the package's (a source tree)."""
    try:
        return metadata.version("tf-towers")
    except metadata.PackageNotFoundError:
        from towers import __version__  # here: importing towers starts TensorFlow

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towers",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show TensorFlow's start-up lines (oneDNN, CPU features)",
    )
    parser.add_argument(  # the distribution's name: the index's "towers" is another
        "--version", action="version", version=f"tf-towers {_version()}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    devices = commands.add_parser(
        "devices",
        help="list physical and logical devices",
        description=DEVICES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    devices.add_argument(
        "--virtual",
        type=positive_int,
        metavar="N",
        help="split one device into N logical devices before listing",
    )
    devices.add_argument(
        "--kind",
        choices=["CPU", "GPU"],
        default="CPU",
        help="which device --virtual splits (default: CPU)",
    )
    devices.set_defaults(run=run_devices)

    demo = commands.add_parser(
        "demo",
        help="train a small model with towers and show what happened",
        description=DEMO_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_towers_and_batch(demo)
    demo.add_argument(
        "--epochs", type=positive_int, default=12, help="epochs (default: 12)"
    )
    demo.add_argument(
        "--log-dir",
        metavar="DIR",
        help="write TensorBoard summaries (loss, accuracy, step time, examples/s, "
        "learning rate) and a profiler trace of steps 10-12 to DIR; view them with "
        "`tensorboard --logdir DIR`",
    )
    demo.set_defaults(run=run_demo)
    _add_explain(commands)
    add_bench_parser(commands)
    _add_launch(commands)
    return parser


def _add_towers_and_batch(parser) -> None:
    """The demo model's --towers and --batch (demo, explain)."""
    parser.add_argument(
        "--towers",
        type=positive_int,
        default=4,
        metavar="N",
        help="number of towers; uses N GPUs if there are, else N logical CPUs "
        "(default: 4)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help="global batch size; need not divide by --towers (default: 64)",
    )


def _add_explain(commands) -> None:
    explain = commands.add_parser(
        "explain",
        help="show where every variable and op of a step lived",
        description=EXPLAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_towers_and_batch(explain)
    explain.add_argument(
        "--placement",
        choices=["central", "balanced", "replicated"],
        default="central",
        help="where the variables live: all on the variable device (central, the "
        "default), spread over the towers' devices (balanced) or a copy per tower "
        "(replicated)",
    )
    explain.add_argument(
        "--variable-device",
        default="/cpu:0",
        metavar="DEVICE",
        help="the variable device under central placement (default: /cpu:0)",
    )
    explain.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile each tower's forward and backward pass with XLA, and list "
        "the XLA computations",
    )
    explain.add_argument(
        "--check",
        action="store_true",
        help="also run the step against Keras' own train_step on one device and "
        "print every variable's relative difference (nothing is kept)",
    )
    explain.add_argument("--png", metavar="FILE", help="draw the step to FILE (PNG)")
    explain.add_argument(
        "--json", metavar="FILE", help="write the report's data to FILE (JSON)"
    )
    explain.set_defaults(run=run_explain)


def _add_launch(commands) -> None:
    launch = commands.add_parser(
        "launch",
        help="run a command as N local workers with TF_CONFIG",
        description=LAUNCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument(
        "--workers", type=positive_int, required=True, metavar="N", help="workers"
    )
    launch.add_argument(
        "--towers-per-worker",
        type=positive_int,
        metavar="T",
        help="exported to each worker as TOWERS_PER_WORKER",
    )
    launch.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the workers advertise to each other (default: 127.0.0.1; "
        "another needs --network host)",
    )
    launch.add_argument(
        "--network",
        choices=["private", "host"],
        default="private",
        help="private: a network namespace of the job's own (default); host: the "
        "machine's network, the workers' ports open to it",
    )
    launch.add_argument(
        "--grace",
        type=positive_float,
        default=GRACE_SECONDS,
        metavar="SECONDS",
        help="how long the workers have to stop after a SIGTERM or SIGINT is passed "
        f"on, before SIGKILL (default: {GRACE_SECONDS:g})",
    )
    launch.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command to run"
    )
    launch.set_defaults(run=run_launch)


def run_devices(args: argparse.Namespace) -> int:
    from towers.devices import describe_devices, virtual_devices

    if args.virtual:
        virtual_devices(args.virtual, kind=args.kind)
    rows = describe_devices()
    width = max(len(r["name"]) for r in rows)
    print(f"{'level':<9} {'kind':<5} {'name':<{width}}")
    for row in rows:
        print(f"{row['level']:<9} {row['kind']:<5} {row['name']:<{width}}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from towers.demo import run

    return run(
        num_towers=args.towers,
        epochs=args.epochs,
        batch=args.batch,
        log_dir=args.log_dir,
    )


def run_explain(args: argparse.Namespace) -> int:
    from towers.demo import explain

    return explain(
        num_towers=args.towers,
        batch=args.batch,
        placement=args.placement,
        variable_device=args.variable_device,
        png=args.png,
        json_path=args.json,
        jit_compile=args.jit_compile,
        check=args.check,
    )


def run_launch(args: argparse.Namespace) -> int:
    from towers.cluster.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(
        command,
        args.workers,
        args.towers_per_worker,
        args.host,
        network=args.network,
        grace=args.grace,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:  # launch's workers too
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command != "launch":  # launch starts no TensorFlow
        start_tensorflow(verbose=args.verbose)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as error:
        print(f"towers {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

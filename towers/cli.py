"""The ``towers`` command.

Each command imports TensorFlow only when it runs, and splits devices first: logical
devices can only be made before TensorFlow initialises.
"""

from __future__ import annotations

import argparse
import os
import sys

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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towers",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    demo.add_argument(
        "--towers",
        type=positive_int,
        default=4,
        metavar="N",
        help="number of towers; uses N GPUs if there are, else N logical CPUs "
        "(default: 4)",
    )
    demo.add_argument(
        "--epochs", type=positive_int, default=12, help="epochs (default: 12)"
    )
    demo.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help="global batch size; need not divide by --towers (default: 64)",
    )
    demo.add_argument(
        "--log-dir",
        metavar="DIR",
        help="write TensorBoard summaries (loss, accuracy, step time, examples/s, "
        "learning rate) and a profiler trace of steps 10-12 to DIR; view them with "
        "`tensorboard --logdir DIR`",
    )
    demo.set_defaults(run=run_demo)
    return parser


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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as error:
        print(f"towers {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

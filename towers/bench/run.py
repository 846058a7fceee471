"""``towers bench``: every configuration in its own process, results gathered.

Each configuration (towers with one placement and reducer, or a baseline) runs in
a fresh ``python -m towers.bench.measure`` process: logical devices must be made
before TensorFlow starts, and one contender's threads and memory must not colour
the next one's times. Each process times its contender beside the plain
single-device step on the same batch; see ``towers/bench/measure.py``.

``--batch`` is per tower, as in tf_cnn_benchmarks: T towers train on T x batch
examples per step, so examples/s can scale with T. Speedup is examples/s over the
same contender's at 1 tower; efficiency is speedup / T.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# CLI placement names -> (Towers placement, where its variable device is).
PLACEMENTS = {
    "cpu": ("central", "cpu"),
    "tower0": ("central", "tower0"),
    "balanced": ("balanced", None),
    "replicated": ("replicated", None),
    "independent": ("independent", None),
}
BASELINES = ("single", "naive", "mirrored", "central_storage")
# towers/bench/presets.py's models (named here so the CLI needn't import Keras).
PRESET_NAMES = ("mlp", "cnn", "embedding", "resnet")


@dataclasses.dataclass
class BenchOptions:
    """What ``towers bench`` was asked for (the CLI's flags, validated)."""

    preset: str = "mlp"
    towers: Sequence[int] = (1, 2, 4)
    reducers: Sequence[str] = ("per_tensor",)
    placements: Sequence[str] = ("cpu",)
    batch: int = 64
    steps: int = 50
    baselines: Sequence[str] = BASELINES
    max_seconds: float | None = None
    xla: bool = False  # also each towers configuration, and single, with XLA


def configurations(options: BenchOptions) -> list[dict[str, Any]]:
    """Every process to run, in order: per tower count, towers then baselines.

    The plain single-device baseline runs once (its ratio to itself is the
    noise floor); the strategies run at each tower count. With ``xla``, each
    towers configuration and the single-device step also run compiled with
    XLA (``jit_compile``), each right after its twin without.
    """
    compiled = [False, True] if options.xla else [False]
    configs = []
    if "single" in options.baselines:
        for jit in compiled:
            configs.append({"contender": "single", "towers": 1, "jit_compile": jit})
    for num in options.towers:
        for placement in options.placements:
            for reducer in options.reducers:
                for jit in compiled:
                    configs.append(
                        {
                            "contender": "towers",
                            "towers": num,
                            "placement": placement,
                            "reducer": reducer,
                            "jit_compile": jit,
                        }
                    )
        for baseline in options.baselines:
            if baseline != "single":
                configs.append({"contender": baseline, "towers": num})
    return configs


def label(config: dict[str, Any]) -> str:
    """The contender's name in tables and plots, without the tower count."""
    xla = " xla" if config.get("jit_compile") else ""
    if config["contender"] != "towers":
        return config["contender"] + xla
    return f"towers {config['placement']} {config['reducer']}{xla}"


def run_bench(
    options: BenchOptions,
    devices: list[str],
    virtual: int | None,
    on_progress: Callable[[int, int, str], None] = lambda done, total, name: None,
) -> dict[str, Any]:
    """Runs every configuration; stops starting new ones at the deadline.

    Args:
      options: the validated options.
      devices: the device names the towers use, at least max(towers) of them.
      virtual: how many logical devices each process splits off (None: none).
      on_progress: called before each configuration and once at the end.

    Returns:
      ``{"records": [...], "timed_out": bool, ...}``; each record is its
      configuration plus the measurement, or ``"status"`` saying why it has none.
    """
    configs = configurations(options)
    deadline = (
        None if options.max_seconds is None else time.monotonic() + options.max_seconds
    )
    records, timed_out = [], False
    for index, config in enumerate(configs):
        on_progress(index, len(configs), f"{label(config)} x{config['towers']}")
        remaining = None if deadline is None else deadline - time.monotonic()
        if timed_out or (remaining is not None and remaining <= 0):
            timed_out = True
            records.append({**config, "status": "not run: --max-seconds reached"})
            continue
        record = _run_one(config, options, devices, virtual, remaining)
        timed_out = record.get("status", "").startswith("timed out")
        records.append(record)
    on_progress(len(configs), len(configs), "done")
    _add_scaling(records)
    return {"records": records, "timed_out": timed_out}


def _run_one(config, options, devices, virtual, timeout) -> dict[str, Any]:
    spec = measure_spec(config, options, devices, virtual)
    command = [sys.executable, "-m", "towers.bench.measure", json.dumps(spec)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {**config, "status": f"timed out after {timeout:.0f} s (--max-seconds)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**config, "status": f"failed: {reason}"}
    return {**config, "status": "ok", **json.loads(lines[-1])}


def measure_spec(config, options, devices, virtual) -> dict[str, Any]:
    """What one measuring process is told: its contender, model and devices."""
    num = config["towers"]
    placement, variable_device = PLACEMENTS.get(config.get("placement", "cpu"))
    return {
        **config,
        "placement": placement,
        "preset": options.preset,
        "batch": options.batch,
        "steps": options.steps,
        "devices": devices[:num],
        "virtual": virtual,
        # --virtual splits the kind of device the towers run on.
        "kind": "GPU" if "GPU" in devices[0] else "CPU",
        "variable_device": devices[0] if variable_device == "tower0" else "/cpu:0",
    }


def _add_scaling(records: list[dict[str, Any]]) -> None:
    """Speedup and efficiency of each contender against its own 1-tower run."""
    one_tower = {
        label(r): r["examples_per_second"]
        for r in records
        if r["status"] == "ok" and r["towers"] == 1
    }
    for record in records:
        base = one_tower.get(label(record))
        if record["status"] == "ok" and base:
            record["speedup"] = record["examples_per_second"] / base
            record["efficiency"] = record["speedup"] / record["towers"]


def choose_devices(
    max_towers: int, num_gpus: int, virtual: bool
) -> tuple[list[str], int | None, str]:
    """The towers' devices, how many logical devices to split off, and a note.

    With GPUs, towers go on GPUs and asking for more than there are is an error
    unless ``virtual`` (split the first GPU). With no GPU the CPU is split into
    ``max_towers`` logical devices: there is nothing else to measure on.

    Raises:
      ValueError: more towers than GPUs without ``virtual``.

    Example:
      >>> choose_devices(2, num_gpus=0, virtual=False)[0]
      ['/device:CPU:0', '/device:CPU:1']
    """
    kind = "GPU" if num_gpus else "CPU"
    names = [f"/device:{kind}:{i}" for i in range(max_towers)]
    if virtual or not num_gpus:
        note = f"{max_towers} logical {kind}s split from one physical {kind}"
        return names, max_towers, note
    if max_towers > num_gpus:
        raise ValueError(
            f"--towers asks for up to {max_towers} towers but this machine has "
            f"{num_gpus} GPU(s); received more towers than devices. Pass --virtual "
            "to split the first GPU into logical devices, or ask for fewer towers."
        )
    return names, None, f"{max_towers} of {num_gpus} GPUs"

"""``towers bench --workers W``: the same preset as W local worker processes,
against the least this machine allows and against MultiWorkerMirroredStrategy.

W processes on loopback (``towers/bench/worker.py`` is each one) join one cluster
through ``Towers``' runtime start; ``tf.distribute.MultiWorkerMirroredStrategy``
then joins the same runtime in the same processes, so both train the same Keras
model on the same rows, with T towers per worker for towers and one replica per
worker for MWMS (all it has on CPUs: it is compared at T = 1 only). The chief
times both cluster steps, the plain single-device step on the whole global batch
and one process with W x T towers, in alternating rounds; the other workers
follow the same schedule. ``towers / mwms`` is a ratio of the same rounds.

**The CPU floor.** The workers of a local run share this machine's cores: no
schedule, overlap included, makes a step shorter than the CPU every worker spends
on it, over the cores. Each worker counts its process's CPU (``time.process_time``,
every thread) round by round while all of them run the same cluster steps; a
round's floor is the workers' summed CPU over the cores, and the step's overhead
over the floor is the round's wall time over it. Its target is ``<= 1.15``; the
rounds give its spread. (The floor holds for one machine only: workers on
separate machines do not share cores. CPU a transport spent spinning would count
in it and flatter the ratio: TensorFlow's gRPC transport blocks instead.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from towers.cluster.launch import free_ports, tf_configs

# Issue 16: a cluster step within 1.15x the CPU its workers spend, over the cores.
TARGET_VS_FLOOR = 1.15
# And no slower than MultiWorkerMirroredStrategy on the same model and workers.
TARGET_VS_MWMS = 1.0
JOBS = ("towers", "mwms")


def run_workers(
    preset: str,
    workers: int,
    towers_per_worker: int = 1,
    batch: int = 64,
    steps: int = 50,
    timeout: float = 900.0,
    peers: Sequence[str] = ("mwms",),
) -> dict[str, Any]:
    """Starts the worker processes and returns the chief's record, with every
    worker's CPU floor rounds folded in.

    Returns:
      ``{"preset", "workers", "towers_per_worker", "batch", "steps", "cores",
      "global_batch", "exchange", "towers": record, "mwms": record,
      "towers_vs_mwms": ratio}``. A contender's record holds its step time, its
      ratios to the chief's single-device and one-process steps, its CPU floor
      (``vs_floor`` and spread) and each worker's weights digest; a peer that
      could not run has ``"status"`` saying why, with its error.

    Raises:
      RuntimeError: a worker failed or the job took longer than ``timeout``; the
        message holds the end of its output.
    """
    if towers_per_worker != 1:
        peers = []  # MWMS has one replica per worker on CPUs: not the same step
    spec = dict(
        preset=preset,
        towers_per_worker=towers_per_worker,
        batch=batch,
        steps=steps,
        peers=list(peers),
    )
    lines = _run_job(spec, workers, timeout)
    cores = machine_cores()
    result = {"workers": workers, **spec, "cores": cores, **lines[0]}
    for name in ("towers", *peers):
        if name not in result:
            error = result.pop(f"{name}_error", "did not run")
            result[name] = {"status": f"failed: {error}"}
            continue
        mine = [line[name] for line in lines]
        result[name].update(status="ok", **cpu_floor(mine, cores))
        for key in ("weights_digest", "round_cpu_ms", "round_wall_ms"):
            result[name][key] = [m[key] for m in mine]  # per worker
    result["exchange"]["cpu_ms"] = [line["exchange"]["cpu_ms"] for line in lines]
    return result


def _run_job(spec, workers: int, timeout: float) -> list[dict[str, Any]]:
    """Every worker's JSON line, the chief's first."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "towers.bench.worker", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TF_CONFIG": config, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        for config in tf_configs(addresses)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            left = max(1.0, deadline - time.monotonic())
            outputs.append(process.communicate(timeout=left)[0])
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"the {workers}-worker bench took longer than {timeout:g} s"
        ) from None
    finally:
        for process in processes:
            process.kill()
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        if process.returncode != 0:
            raise RuntimeError(
                f"bench worker {rank} failed (exit {process.returncode}): "
                + output[-2000:]
            )
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def machine_cores() -> int:
    """The cores this process (and the workers it starts) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_floor(lines: list[dict[str, Any]], cores: int) -> dict[str, Any]:
    """The least each round's cluster steps could take with the workers sharing
    ``cores``, and the step's overhead over it.

    ``lines``: each worker's record, with its CPU and wall milliseconds per
    cluster step in each round of the floor loop (``round_cpu_ms``,
    ``round_wall_ms``; the rounds run in step on every worker).

    >>> lines = [{"round_cpu_ms": [9.0, 8.0], "round_wall_ms": [10.0, 9.0]},
    ...          {"round_cpu_ms": [7.0, 8.0], "round_wall_ms": [10.0, 9.6]}]
    >>> floor = cpu_floor(lines, cores=2)
    >>> floor["cpu_floor_ms"], floor["round_vs_floor"]
    (8.0, [1.25, 1.2])
    """
    cpu = np.array([line["round_cpu_ms"] for line in lines])
    # A round ends when its slowest worker does.
    wall = np.max([line["round_wall_ms"] for line in lines], axis=0)
    floor = cpu.sum(axis=0) / cores
    ratios = wall / floor
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return {
        "step_cpu_ms": [float(ms) for ms in np.median(cpu, axis=1)],
        "step_wall_ms": float(np.median(wall)),
        "cpu_floor_ms": float(np.median(floor)),
        "round_vs_floor": [round(float(r), 4) for r in ratios],
        "vs_floor": float(median),
        "vs_floor_q25": float(low),
        "vs_floor_q75": float(high),
    }


def verdict(ratio: float, q25: float, target: float) -> str:
    """Meets, within noise (the target inside the rounds' spread), or MISSES.

    >>> verdict(1.2, 1.1, 1.15), verdict(1.1, 1.0, 1.15), verdict(1.3, 1.2, 1.15)
    ('within noise', 'meets', 'MISSES')
    """
    if ratio <= target:
        return "meets"
    return "within noise" if q25 <= target else "MISSES"


def describe(result: dict[str, Any]) -> str:
    """The terminal report: each contender against its CPU floor, one device and
    one process, then towers against MWMS, each with its rounds' spread."""
    w, t = result["workers"], result["towers_per_worker"]
    towers = result["towers"]
    lines = [
        f"{result['preset']}: {w} workers x {t} tower(s) on loopback, global batch "
        f"{result['global_batch']}, {result['cores']} shared cores",
        f"{'':<7} {'ms/step':>8}  {'vs CPU floor':<22} {'vs 1 device':<22} "
        f"vs 1 process x {w * t} towers",
    ]
    for name in JOBS:
        record = result.get(name)
        if record is None:
            continue
        if record["status"] != "ok":
            lines.append(f"{name:<7} {record['status']}")
            continue
        lines.append(
            f"{name:<7} {record['ms']:8.2f}  {_spread(record, 'vs_floor'):<22} "
            f"{_spread(record, 'vs_single'):<22} {_spread(record, 'vs_one_process')}"
        )
    cpu = " + ".join(f"{ms:.1f}" for ms in towers["step_cpu_ms"])
    lines.append(
        f"towers vs its CPU floor: {towers['step_wall_ms']:.2f} ms/step while its "
        f"workers spent {cpu} CPU ms on {result['cores']} cores (floor "
        f"{towers['cpu_floor_ms']:.2f} ms): {towers['vs_floor']:.3f}, target "
        f"<= {TARGET_VS_FLOOR}: "
        + verdict(towers["vs_floor"], towers["vs_floor_q25"], TARGET_VS_FLOOR)
    )
    exchange = result["exchange"]
    sums = " + ".join(f"{ms:.1f}" for ms in exchange["cpu_ms"])
    lines.append(
        f"  its cross-worker sum alone ({exchange['gradient_bytes'] / 1e6:.2f} MB "
        f"of gradients, no compute): {exchange['ms']:.2f} ms, {sums} CPU ms"
    )
    if "towers_vs_mwms" in result:
        r = result["towers_vs_mwms"]
        lines.append(
            f"towers / mwms (timed in turns, same processes): {r['ratio']:.3f} "
            f"[{r['ratio_q25']:.3f}, {r['ratio_q75']:.3f}], target <= "
            f"{TARGET_VS_MWMS}: " + verdict(r["ratio"], r["ratio_q25"], TARGET_VS_MWMS)
        )
    return "\n".join(lines)


def _spread(record: dict[str, Any], name: str) -> str:
    return (
        f"{record[name]:.3f} [{record[f'{name}_q25']:.3f}, {record[f'{name}_q75']:.3f}]"
    )

"""``towers bench --workers W``: the same preset as W local worker processes.

W processes on loopback, each a worker of one cluster with ``TOWERS_PER_WORKER``
towers (the collective runtime carries the cross-worker sum), against one process
with W × T towers on the same global batch. Both are timed in the chief, in
alternating rounds, so their ratio cancels the noise both see: the chief's
process also holds the one-process engine, and while it times that one, the
other workers wait in their next step's collective.

Each worker also counts the CPU time its process spends per cluster step
(``time.process_time``, every thread), and per cross-worker sum alone. The workers
of a local run share this machine's cores, so no schedule, overlap included, can
make a step shorter than their summed CPU time over the cores: ``cpu_floor_ms``.
Over the one-process step it is the lowest ratio this machine can show
(``cpu_floor_ratio``); when it is above the target, no schedule or overlap of
this step's work reaches the target here, and the report says so. (The floor
holds for a local run only: workers on separate machines do not share cores.)

Run as ``python -m towers.bench.workers SPEC_JSON`` in each worker (the parent
sets ``TF_CONFIG``); each prints one JSON line, the chief's with the timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from towers.launch import free_ports, tf_configs

# The target of issue 5: W workers × 1 tower within 1.3× one process of W towers.
TARGET = 1.3
# How long a worker waits for the others: the chief's one-process rounds included.
TIMEOUT_SECONDS = 300.0


def run_workers(
    preset: str,
    workers: int,
    towers_per_worker: int = 1,
    batch: int = 64,
    steps: int = 50,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Starts the worker processes and returns the chief's record.

    Raises:
      RuntimeError: a worker failed or the job took longer than ``timeout``; the
        message holds the end of its output.
    """
    spec = dict(
        preset=preset,
        towers_per_worker=towers_per_worker,
        batch=batch,
        steps=steps,
    )
    addresses = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "towers.bench.workers", json.dumps(spec)],
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
    lines = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    record = {"preset": preset, "workers": workers, **spec, **lines[0]}
    record.update(cpu_floor(lines, record["one_process_ms"], machine_cores()))
    return record


def machine_cores() -> int:
    """The cores this process (and the workers it starts) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_floor(
    lines: list[dict[str, Any]], one_process_ms: float, cores: int
) -> dict[str, Any]:
    """The least a cluster step can take when its workers share ``cores``.

    ``lines``: each worker's record, with the CPU milliseconds its process spent
    per cluster step (``step_cpu_ms``, over ``step_wall_ms``) and per cross-worker
    sum (``sum_cpu_ms``).

    >>> line = {"step_wall_ms": 9.5, "sum_cpu_ms": 5.0}
    >>> floor = cpu_floor([{**line, "step_cpu_ms": 9.0},
    ...                    {**line, "step_cpu_ms": 7.0}], 4.0, cores=2)
    >>> floor["cpu_floor_ms"], floor["cpu_floor_ratio"]
    (8.0, 2.0)
    """
    step_cpu = [line["step_cpu_ms"] for line in lines]
    floor_ms = sum(step_cpu) / cores
    return {
        "cores": cores,
        "step_cpu_ms": step_cpu,
        "step_wall_ms": [line["step_wall_ms"] for line in lines],
        "sum_cpu_ms": [line["sum_cpu_ms"] for line in lines],
        "cpu_floor_ms": floor_ms,
        "cpu_floor_ratio": floor_ms / one_process_ms,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from towers.cluster import Cluster
    from towers.devices import virtual_devices

    cluster = Cluster.from_tf_config(
        timeout_seconds=TIMEOUT_SECONDS, startup_timeout_seconds=TIMEOUT_SECONDS
    )
    per_worker = spec["towers_per_worker"]
    # Room for the one-process engine's W × T towers (in the chief).
    devices = virtual_devices(per_worker * cluster.num_workers)
    cluster.start()
    record = measure(spec, cluster, devices)
    print(json.dumps(record), flush=True)
    return 0


def measure(spec: dict[str, Any], cluster, devices: list[str]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from towers.bench.presets import get_preset
    from towers.bench.timing import interleaved_ratio
    from towers.engine import Towers

    keras.utils.set_random_seed(0)
    preset = get_preset(spec["preset"])
    per_worker = spec["towers_per_worker"]
    global_batch = spec["batch"] * per_worker * cluster.num_workers
    x, y = preset.batch(global_batch, seed=0)
    share = global_batch // cluster.num_workers
    rows = slice(cluster.index * share, (cluster.index + 1) * share)

    def engine(towers, in_cluster):
        return Towers(
            preset.build,
            preset.loss(),
            lambda: keras.optimizers.SGD(0.01),
            devices=towers,
            cluster=cluster if in_cluster else None,
            reducer="packed",
        )

    distributed = engine(devices[:per_worker], True)
    x_w, y_w = tf.constant(x[rows]), tf.constant(y[rows])

    def cluster_step():
        return distributed.train_step(x_w, y_w)

    rounds = max(2, spec["steps"] // 10)
    steps = max(1, spec["steps"] // rounds)
    warmup = 5
    # The step's cross-worker sum alone (the same tensors, zeros), no compute.
    zeros = [tf.zeros(v.shape, v.dtype) for v in distributed.model.trainable_variables]
    exchange = tf.function(
        lambda: [
            distributed.workers.step(zeros, tf.constant(0.0), share, [], share).loss
        ]
    )
    if cluster.is_chief:
        local = engine(devices, False)
        x_all, y_all = tf.constant(x), tf.constant(y)
        timed = interleaved_ratio(
            cluster_step,
            lambda: local.train_step(x_all, y_all),
            rounds=rounds,
            steps=steps,
            warmup=warmup,
        )
    else:
        # The chief's schedule: warm-up, then `steps` cluster steps per round.
        for _ in range(warmup + rounds * steps):
            cluster_step()["loss"].numpy()
    # From here every worker runs the same loops, in step with the others: the
    # exchange alone, then cluster steps, each under this process's CPU clock.
    for _ in range(warmup):
        exchange()[0].numpy()
    exchange_s, sum_cpu_s = _timed(lambda: exchange()[0], rounds * steps)
    step_s, step_cpu_s = _timed(lambda: cluster_step()["loss"], rounds * steps)
    cpu = {
        "step_cpu_ms": 1e3 * step_cpu_s,
        "step_wall_ms": 1e3 * step_s,
        "sum_cpu_ms": 1e3 * sum_cpu_s,
    }
    if not cluster.is_chief:
        return cpu
    grad_bytes = sum(int(z.shape.num_elements()) * z.dtype.size for z in zeros)
    return {
        **cpu,
        "global_batch": global_batch,
        "exchange_ms": 1e3 * exchange_s,
        "gradient_bytes": grad_bytes,
        "cluster_ms": timed["contender_ms"],
        "one_process_ms": timed["baseline_ms"],
        "ratio": timed["ratio"],
        "ratio_q25": timed["ratio_q25"],
        "ratio_q75": timed["ratio_q75"],
        "target": TARGET if per_worker == 1 else None,
    }


def _timed(step, steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds per step over ``steps`` calls."""
    from towers.bench.timing import time_steps

    cpu = time.process_time()
    wall = time_steps(step, steps)
    return wall, (time.process_time() - cpu) / steps


def describe(record: dict[str, Any]) -> str:
    """Three lines for the terminal: the ratio, the sum alone, the CPU floor."""
    w, t = record["workers"], record["towers_per_worker"]
    target = record.get("target")
    verdict = ""
    if target is not None:
        if record["ratio"] <= target:
            verdict = f"  meets the target <= {target}"
        elif record["ratio_q25"] <= target:
            verdict = f"  within noise of the target <= {target}"
        else:
            verdict = f"  MISSES the target <= {target}"
    floor = record["cpu_floor_ratio"]
    reach = ""
    if target is not None and floor > target:
        budget = target * record["one_process_ms"] * record["cores"]
        reach = (
            f"\n  the target <= {target} needs under {budget:.1f} CPU ms per step "
            "in all: no schedule or overlap reaches it on this machine"
        )
    steps = " + ".join(f"{ms:.1f}" for ms in record["step_cpu_ms"])
    sums = " + ".join(f"{ms:.1f}" for ms in record["sum_cpu_ms"])
    return (
        f"{record['preset']}: {w} workers x {t} tower(s) {record['cluster_ms']:.2f} "
        f"ms/step vs 1 process x {w * t} towers {record['one_process_ms']:.2f} "
        f"ms/step (global batch {record['global_batch']}): ratio "
        f"{record['ratio']:.3f} [{record['ratio_q25']:.3f}, "
        f"{record['ratio_q75']:.3f}]{verdict}\n"
        f"  the cross-worker sum alone ({record['gradient_bytes'] / 1e6:.2f} MB of "
        f"gradients, no compute): {record['exchange_ms']:.2f} ms, {sums} CPU ms\n"
        f"  CPU per cluster step: {steps} ms on {record['cores']} shared cores, so "
        f"no step can take under {record['cpu_floor_ms']:.2f} ms: ratio >= "
        f"{floor:.2f}{reach}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

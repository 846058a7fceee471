"""``towers bench --workers W``: the same preset as W local worker processes.

W processes on loopback, each a worker of one cluster with ``TOWERS_PER_WORKER``
towers (the collective runtime carries the cross-worker sum), against one process
with W × T towers on the same global batch. Both are timed in the chief, in
alternating rounds, so their ratio cancels the noise both see: the chief's
process also holds the one-process engine, and while it times that one, the
other workers wait in their next step's collective.

Run as ``python -m towers.bench.workers SPEC_JSON`` in each worker (the parent
sets ``TF_CONFIG``); the chief prints one JSON line.
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
    record = json.loads(outputs[0].strip().splitlines()[-1])
    return {"preset": preset, "workers": workers, **spec, **record}


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
    if cluster.is_chief:
        print(json.dumps(record), flush=True)
    return 0


def measure(spec: dict[str, Any], cluster, devices: list[str]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from towers.bench.presets import get_preset
    from towers.bench.timing import interleaved_ratio, time_steps
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
        lambda: distributed.workers.step(zeros, tf.constant(0.0), share, [], True)[1:2]
    )
    if not cluster.is_chief:
        # The chief's schedule: warm-up, then `steps` cluster steps per round,
        # then the exchange alone.
        for _ in range(warmup + rounds * steps):
            cluster_step()["loss"].numpy()
        for _ in range(warmup + rounds * steps):
            exchange()[0].numpy()
        return {}
    local = engine(devices, False)
    x_all, y_all = tf.constant(x), tf.constant(y)
    timed = interleaved_ratio(
        cluster_step,
        lambda: local.train_step(x_all, y_all),
        rounds=rounds,
        steps=steps,
        warmup=warmup,
    )
    for _ in range(warmup):
        exchange()[0].numpy()
    exchange_s = time_steps(lambda: exchange()[0], rounds * steps)
    grad_bytes = sum(int(z.shape.num_elements()) * z.dtype.size for z in zeros)
    return {
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


def describe(record: dict[str, Any]) -> str:
    """One line for the terminal."""
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
    return (
        f"{record['preset']}: {w} workers x {t} tower(s) {record['cluster_ms']:.2f} "
        f"ms/step vs 1 process x {w * t} towers {record['one_process_ms']:.2f} "
        f"ms/step (global batch {record['global_batch']}): ratio "
        f"{record['ratio']:.3f} [{record['ratio_q25']:.3f}, "
        f"{record['ratio_q75']:.3f}]{verdict}\n"
        f"  the cross-worker sum alone ({record['gradient_bytes'] / 1e6:.2f} MB of "
        f"gradients, no compute): {record['exchange_ms']:.2f} ms"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One worker process of ``towers bench --workers`` (``towers/bench/workers.py``).

Run as ``python -m towers.bench.worker SPEC_JSON`` with ``TF_CONFIG`` set; prints
one JSON line. The process joins the cluster through ``Towers``' own runtime
start, then, with ``spec["peers"] == ["mwms"]``, makes a
``MultiWorkerMirroredStrategy`` on the same runtime, so both train the same
model on this worker's rows of the same global batch in the same processes.

Every worker runs the same sequence of collectives, in step with the others:

1. the chief times the cluster steps (towers', MWMS's), the plain single-device
   step on the whole global batch and one process with W x T towers, in
   alternating rounds; the other workers run the same rounds' cluster steps only
   (they wait in the next collective while the chief times its local steps);
2. towers' cross-worker sum alone (zeros, no compute), under the CPU clock;
3. the floor rounds: for each contender, every worker times the same rounds of
   its cluster steps under its process's CPU clock and the wall clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

# How long a worker waits for the others: the chief's one-process rounds included.
TIMEOUT_SECONDS = 300.0
WARMUP = 5
# Timed in the chief only; every other step is a cluster step all workers run.
CHIEF_ONLY = ("single", "one_process")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from towers.cluster.cluster import Cluster
    from towers.devices import virtual_devices

    cluster = Cluster.from_tf_config(
        timeout_seconds=TIMEOUT_SECONDS, startup_timeout_seconds=TIMEOUT_SECONDS
    )
    # Room for the one-process engine's W x T towers (in the chief).
    devices = virtual_devices(spec["towers_per_worker"] * cluster.num_workers)
    cluster.start()
    print(json.dumps(measure(spec, cluster, devices)), flush=True)
    return 0


def measure(spec: dict[str, Any], cluster, devices: list[str]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from towers.bench.peers import single_device_step
    from towers.bench.presets import get_preset
    from towers.bench.timing import interleaved, ratio, round_order

    keras.utils.set_random_seed(0)
    preset = get_preset(spec["preset"])
    rank, size = cluster.index, cluster.num_workers
    global_batch = spec["batch"] * spec["towers_per_worker"] * size
    x, y = preset.batch(global_batch, seed=0)
    share = global_batch // size
    rows = slice(rank * share, (rank + 1) * share)
    x_w, y_w = tf.constant(x[rows]), tf.constant(y[rows])
    engine = _engine(preset, devices[: spec["towers_per_worker"]], cluster)
    steps = {"towers": lambda: engine.train_step(x_w, y_w)["loss"]}
    models = {"towers": engine.model}
    record: dict[str, Any] = {"global_batch": global_batch}
    if "mwms" in spec["peers"]:
        try:
            steps["mwms"], models["mwms"] = _mwms(preset, x_w, y_w, global_batch)
        except Exception as error:  # noqa: BLE001 - reported in the table
            # Every worker fails alike (same model, same TensorFlow).
            record["mwms_error"] = f"{type(error).__name__}: {error}"[:500]
    contenders = list(steps)
    if rank == 0:
        x_all, y_all = tf.constant(x), tf.constant(y)
        single = single_device_step(preset.build, preset.loss(), "/device:CPU:0")
        local = _engine(preset, devices, None)
        steps["single"] = lambda: single(x_all, y_all)
        steps["one_process"] = lambda: local.train_step(x_all, y_all)["loss"]

    rounds = max(2, spec["steps"] // 10)
    per_round = max(1, spec["steps"] // rounds)
    if rank == 0:
        times = interleaved(steps, rounds, per_round, WARMUP)
        for name in contenders:
            record[name] = {
                **_ratios(ratio(times, name, "single"), "single"),
                **_ratios(ratio(times, name, "one_process"), "one_process"),
            }
        if "mwms" in contenders:
            record["towers_vs_mwms"] = ratio(times, "towers", "mwms")
    else:
        # The chief's schedule, without its local steps.
        names = list(steps)
        for name in names:
            for _ in range(WARMUP):
                steps[name]().numpy()
        for r in range(rounds):
            for name in round_order(names + list(CHIEF_ONLY), r):
                if name not in CHIEF_ONLY:
                    for _ in range(per_round):
                        steps[name]().numpy()
    record["exchange"] = _exchange(engine, share, rounds * per_round)
    for name in contenders:
        for _ in range(WARMUP):
            steps[name]().numpy()
        timed = [_timed(steps[name], per_round) for _ in range(rounds)]
        record.setdefault(name, {}).update(
            round_wall_ms=[1e3 * wall for wall, _ in timed],
            round_cpu_ms=[1e3 * cpu for _, cpu in timed],
            weights_digest=_digest(models[name].trainable_variables),
        )
    return record


def _engine(preset, devices, cluster):
    import keras

    from towers.engine import Towers

    return Towers(
        preset.build,
        preset.loss(),
        lambda: keras.optimizers.SGD(0.01),
        devices=devices,
        cluster=cluster,
        reducer="packed",
        # What a cluster needs for BatchNormalization (the resnet preset); the
        # whole global batch's statistics, as the single-device step takes them.
        # Without BatchNormalization layers it changes nothing.
        batch_statistics="global",
    )


def _mwms(preset, x, y, global_batch: int):
    """MultiWorkerMirroredStrategy on the runtime ``Towers`` started (it finds
    it running and joins it), and its step; ``(step, model)``."""
    import tensorflow as tf

    from towers.bench.peers import multi_worker_step

    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=TIMEOUT_SECONDS
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    step, model = multi_worker_step(strategy, preset, x, y, global_batch)
    return step, model


def _exchange(engine, share: int, steps: int) -> dict[str, Any]:
    """Towers' cross-worker sum alone: the step's tensors (zeros), no compute."""
    import tensorflow as tf

    zeros = [tf.zeros(v.shape, v.dtype) for v in engine.model.trainable_variables]
    exchange = tf.function(
        lambda: engine.workers.step(zeros, tf.constant(0.0), share, [], share).loss
    )
    for _ in range(WARMUP):
        exchange().numpy()
    wall, cpu = _timed(exchange, steps)
    sent = sum(int(z.shape.num_elements()) * z.dtype.size for z in zeros)
    return {"ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "gradient_bytes": sent}


def _timed(step, steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds per step over ``steps`` calls."""
    from towers.bench.timing import time_steps

    cpu = time.process_time()
    wall = time_steps(step, steps)
    return wall, (time.process_time() - cpu) / steps


def _ratios(timed: dict[str, float], baseline: str) -> dict[str, float]:
    """``timing.ratio``'s record as ``ms``, ``{baseline}_ms`` and
    ``vs_{baseline}`` with its quartiles."""
    name = f"vs_{baseline}"
    return {
        "ms": timed["contender_ms"],
        f"{baseline}_ms": timed["baseline_ms"],
        name: timed["ratio"],
        f"{name}_q25": timed["ratio_q25"],
        f"{name}_q75": timed["ratio_q75"],
    }


def _digest(variables) -> str:
    """A hash of the weights: every worker of a synchronous job holds the same."""
    digest = hashlib.sha256()
    for v in variables:
        digest.update(v.numpy().tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

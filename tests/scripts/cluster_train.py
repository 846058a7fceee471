"""One worker of a multi-worker test job, or the one-process reference.

As a worker (TF_CONFIG set, e.g. by ``towers launch``): ``TOWERS_PER_WORKER``
towers on logical CPUs, its share of every global batch (``towers.shard``),
and a different random start than the chief's (the chief's must win). As the
reference (``--towers N``, no TF_CONFIG): N towers in one process on the whole
batches. Either way it writes, under ``--out``, ``weights-<rank>.npz`` and
``result-<rank>.json`` (history, evaluation, steps).

Modes:
  steps   train_step over uneven global batches (one is smaller than the
          number of workers), then evaluate.
  fit     fit with metrics and validation, checkpointing every --every steps
          into --checkpoint; --die-at K makes worker 1 exit abruptly at step K.
  explain one step, then ``engine.explain`` on the next batch: the report's
          facts go to the result, with how much explaining changed (nothing).

The engine's update policies reach it too: --accumulate K, --nonfinite POLICY
(with --nan-in K: the last example of global batch K is NaN, which is in the
last worker's share), --policy (a Keras dtype policy, e.g. mixed_float16).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import towers  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=["steps", "fit", "explain"], default="steps")
parser.add_argument("--towers", type=int, default=None)
parser.add_argument("--optimizer", default="adam")
parser.add_argument("--timeout", type=float, default=60.0)
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--every", type=int, default=None)
parser.add_argument("--die-at", type=int, default=None)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--model", default="mlp")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--nonfinite", default="ignore")
parser.add_argument("--nan-in", type=int, default=None)
parser.add_argument("--policy", default="float32")
args = parser.parse_args()

in_cluster = "TF_CONFIG" in os.environ
num_towers = int(os.environ["TOWERS_PER_WORKER"]) if in_cluster else args.towers
devices = towers.virtual_devices(num_towers)
cluster = None
if in_cluster:
    cluster = towers.Cluster.from_tf_config(
        timeout_seconds=args.timeout, startup_timeout_seconds=120
    )
    cluster.start()
rank = cluster.index if cluster else 0

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

# The chief's random start must reach every worker: start each one differently.
keras.utils.set_random_seed(rank)
tf.config.experimental.enable_op_determinism()
keras.config.set_dtype_policy(args.policy)


def build():
    width = 5 if args.model == "wider" and rank == 1 else 4
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(width),
        ]
    )


optimizers = {
    # epsilon: see tests/tolerances.py (ADAM_EPSILON).
    "adam": lambda: keras.optimizers.Adam(0.05, epsilon=1e-3),
    "sgd": lambda: keras.optimizers.SGD(0.1),
}
engine = towers.Towers(
    build,
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizers[args.optimizer],
    devices=devices,
    metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    cluster=cluster,
    accumulate_steps=args.accumulate,
    on_nonfinite=args.nonfinite,
)
# The variables every worker starts from (the chief's, after the engine's start).
start = [v.numpy() for v in engine.model.variables]
# Same data on every worker and in the reference; each worker takes its share.
data = np.random.default_rng(7)
x = data.normal(size=(64, 6)).astype("float32")
y = data.integers(0, 4, size=64).astype("int64")
# The steps mode's global batches: uneven; 1 < workers, so someone gets none.
sizes = [13, 7, 1, 10, 33]
starts = np.cumsum([0, *sizes])
if args.nan_in is not None:
    x[starts[args.nan_in + 1] - 1] = np.nan
result = {"rank": rank}


class DieAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and engine.steps_done == args.die_at:
            print(f"worker 1 dies at step {engine.steps_done}", flush=True)
            os._exit(9)


if args.mode == "steps":
    batches = tf.data.Dataset.from_generator(
        lambda: ((x[a:b], y[a:b]) for a, b in zip(starts, starts[1:])),
        output_signature=(
            tf.TensorSpec((None, 6), tf.float32),
            tf.TensorSpec((None,), tf.int64),
        ),
    )
    losses, errors = [], []
    for xb, yb in towers.shard(batches, cluster):
        try:
            logs = engine.train_step(xb, yb)
        except FloatingPointError as error:
            errors.append(str(error))
            continue
        losses.append(float(logs["loss"]))
    result["losses"] = losses
    result["errors"] = errors
    result["iterations"] = int(engine.optimizer.iterations.numpy())
    if hasattr(engine.optimizer, "dynamic_scale"):
        result["scale"] = float(engine.optimizer.dynamic_scale.numpy())
    result["acc"] = float(engine.metrics[0].result())
    evaluation = towers.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(9))
    result["evaluate"] = engine.evaluate(evaluation)
elif args.mode == "explain":
    share = towers.shard(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16).take(2), cluster
    )
    (x0, y0), (x1, y1) = list(share)
    engine.train_step(x0, y0)
    state = engine.model.variables + engine.optimizer.variables
    before = [v.numpy() for v in state]
    report = engine.explain(x1, y1)
    result["changed_by_explain"] = max(
        float(np.abs(v.numpy() - b).max()) for v, b in zip(state, before)
    )
    result["explain"] = {
        "workers": report.workers,
        "stages": list(report.ops),
        "collective_kinds": sorted(
            {t.kind for t in report.transfers if t.target == "collective group"}
        ),
        "text": str(report),
    }
else:
    train = towers.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(10), cluster)
    valid = towers.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(25), cluster)
    history = engine.fit(
        train,
        epochs=args.epochs,
        validation_data=valid,
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.every,
        callbacks=[DieAt()] if args.die_at else None,
        verbose=1,
    )
    result["history"] = history
result["steps"] = engine.steps_done
np.savez(
    os.path.join(args.out, f"weights-{rank}.npz"),
    *[v.numpy() for v in engine.model.variables],
)
np.savez(os.path.join(args.out, f"start-{rank}.npz"), *start)
with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"worker {rank} done: {result['steps']} steps", flush=True)
sys.exit(0)

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

What a Keras user brings reaches it too: --weighted (per-example sample weights),
--outputs 2 (a two-output model, a loss per output and loss weights); the
default model counts the examples and steps it trained on in a layer of its
own (``Seen``: its variables are among the weights the tests compare).
The engine's update policies reach it too: --accumulate K, --nonfinite POLICY
(with --nan-in K: the last example of global batch K is NaN, which is in the
last worker's share), --policy (a Keras dtype policy, e.g. mixed_float16).
--model bn puts a BatchNormalization layer in, with --batch-statistics global
(and --jit-compile, each tower's pass in XLA computations).
--steps-per-execution K runs fit's steps K to a call, a loop in the graph.
--model moe puts keras_hub's Mixtral mixture-of-experts block in, whose
load-balancing loss couples the batch's examples (computed from the whole
batch: the default coupled_losses="exact"). --model clip is a CLIP-style dual
encoder whose compute_loss is over the whole batch's similarities (gathered);
--model twoapplies has its own train_step, applying twice with two optimizers;
--model twoapplies_bn the same with a BatchNormalization layer (run twice a
step: pass --batch-statistics global); --model gathering has its own steps,
whose loss is over the whole batch's rows, gathered with towers.gather;
--model dropout draws in training (Dropout, GaussianNoise, and noise over
two blocks of the rows). --model unseeded has its own train_step, which
noises its inputs from Keras' global seed generator (``seed=None``) and
holds no generator of its own: refused by name in a cluster.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import towers  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=["steps", "fit", "explain"], default="steps")
parser.add_argument("--towers", type=int, default=None)
parser.add_argument("--optimizer", default="adam")
parser.add_argument("--timeout", type=float, default=60.0)
parser.add_argument("--startup-timeout", type=float, default=120.0)
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--every", type=int, default=None)
parser.add_argument("--die-at", type=int, default=None)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--model", default="mlp")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--nonfinite", default="ignore")
parser.add_argument("--nan-in", type=int, default=None)
parser.add_argument("--policy", default="float32")
parser.add_argument("--weighted", action="store_true")
parser.add_argument("--outputs", type=int, default=1)
parser.add_argument("--slow", action="store_true")
parser.add_argument("--batch-statistics", default="tower")
parser.add_argument("--jit-compile", action="store_true")
parser.add_argument("--in-turns", action="store_true")  # no cut: the lockstep
parser.add_argument("--steps-per-execution", type=int, default=None)
args = parser.parse_args()

in_cluster = "TF_CONFIG" in os.environ
num_towers = int(os.environ["TOWERS_PER_WORKER"]) if in_cluster else args.towers
devices = towers.virtual_devices(num_towers)
cluster = None
if in_cluster:
    cluster = towers.Cluster.from_tf_config(
        timeout_seconds=args.timeout, startup_timeout_seconds=args.startup_timeout
    )
    cluster.start()
rank = cluster.index if cluster else 0

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

if args.in_turns:  # every pass as if it could not be cut: the towers take turns
    from towers.step.run import phases, seats

    def _uncuttable(*arguments, **named):
        raise seats.Unserved("--in-turns")

    phases.compute = _uncuttable

# The chief's random start must reach every worker: start each one differently.
keras.utils.set_random_seed(rank)
tf.config.experimental.enable_op_determinism()
keras.config.set_dtype_policy(args.policy)


class Seen(keras.layers.Layer):
    """What training passes it saw: examples (aggregation "sum": every tower's
    and worker's count adds up) and steps (Keras' default "none": the first
    tower's, once a step), as one process on the whole batch counts them."""

    def build(self, shape):
        zeros = dict(shape=(), initializer="zeros", trainable=False)
        self.examples = self.add_weight(**zeros, aggregation="sum", name="examples")
        self.steps = self.add_weight(**zeros, name="steps")

    def call(self, x, training=False):
        if training:
            self.examples.assign_add(tf.cast(tf.shape(x)[0], self.examples.dtype))
            self.steps.assign_add(1.0)
        return x


class Clip(keras.Model):
    """A CLIP-style dual encoder: an image and a text encoder (the inputs'
    first and last three features), the symmetric cross-entropy over the
    batch's similarity matrix with a learned temperature, plus the image
    embedding classifying the label; a softmax over the whole batch (gathered
    from every tower and worker). Its own Sum metric counts matched pairs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = self.add_weight(shape=(), initializer="zeros", name="scale")
        self.matched = keras.metrics.Sum(name="matched")

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        images, texts = y_pred
        label = keras.ops.mean(classify(y, images))
        images = images / keras.ops.norm(images, axis=1, keepdims=True)
        texts = texts / keras.ops.norm(texts, axis=1, keepdims=True)
        logits = keras.ops.matmul(images, keras.ops.transpose(texts))
        logits = logits * keras.ops.exp(self.scale) * 5.0
        pairs = keras.ops.arange(keras.ops.shape(logits)[0])
        found = keras.ops.cast(keras.ops.argmax(logits, axis=1), pairs.dtype)
        self.matched.update_state(keras.ops.cast(found == pairs, "float32"))
        crossed = [
            keras.losses.sparse_categorical_crossentropy(pairs, z, from_logits=True)
            for z in (logits, keras.ops.transpose(logits))
        ]
        return label + keras.ops.mean(crossed[0] + crossed[1]) / 2


def paired_noise(x, seeds):
    """Noise drawn over two blocks of the rows, halves added."""
    rows = keras.ops.shape(x)[0]
    noise = keras.random.normal((2 * rows, x.shape[1]), seed=seeds)
    return x + 0.1 * (noise[:rows] + noise[rows:])


class PairedNoise(keras.layers.Layer):
    """In training, :func:`paired_noise`."""

    def __init__(self):
        super().__init__()
        self.seeds = keras.random.SeedGenerator(8)

    def call(self, x, training=False):
        return paired_noise(x, self.seeds) if training else x


class Unseeded(keras.Sequential):
    """Its own train_step noises its inputs with ``seed=None``: a value per
    example from Keras' global seed generator, which no worker can place."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x = x + 0.1 * keras.random.normal(keras.ops.shape(x))
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True), sample_weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class TwoApplies(keras.Sequential):
    """A model's own train_step that applies twice: its first layer with the
    compiled optimizer, then, through the updated layer, its last layer with
    a second optimizer of its own (as a GAN's generator after its
    discriminator), from a loss that sums over the examples plus a weight
    penalty; its metrics updated as Keras' guide updates them. It also
    assigns an EMA of its last kernel (the same on every tower), a count of
    examples made to add up, and the batch's mean prediction made to average
    (each shard's differs): each once, as one device would. Its inputs get
    noise drawn over two blocks of their rows, as the fit guide's GAN noises
    its labels over its fake and real rows."""

    def __init__(self, layers):
        super().__init__(layers)
        self.seeds = keras.random.SeedGenerator(8)

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.second = keras.optimizers.SGD(0.05, momentum=0.5)
        last = self.layers[-1].kernel
        state = dict(initializer="zeros", trainable=False)
        self.ema = self.add_weight(shape=last.shape, name="ema", **state)
        self.seen = self.add_weight(shape=(), name="seen", aggregation="sum", **state)
        self.mean = self.add_weight(shape=(), name="mean", aggregation="mean", **state)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x = paired_noise(x, self.seeds)
        variables = self.layers[0].trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        # The second loss sums over the examples, plus a weight penalty.
        variables = self.layers[-1].trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            each = keras.losses.sparse_categorical_crossentropy(
                y, y_pred, from_logits=True
            )
            penalty = 0.01 * tf.reduce_sum(tf.square(variables[0]))
            summed = tf.reduce_sum(each) / 8.0 + penalty
        self.second.apply(tape.gradient(summed, variables), variables)
        self.ema.assign(0.9 * self.ema + 0.1 * self.layers[-1].kernel)
        self.seen.assign_add(tf.cast(tf.shape(y)[0], self.seen.dtype))
        self.mean.assign(tf.reduce_mean(y_pred))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss, sample_weight=tf.shape(y)[0])
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class Gathering(keras.Model):
    """A model's own train_step and test_step whose loss is the symmetric
    cross-entropy over the whole batch's similarity matrix, the embeddings'
    rows gathered with towers.gather from every tower and worker, sharpened
    by a learned temperature the loss reads directly."""

    def __init__(self):
        super().__init__()
        self.images, self.texts = keras.layers.Dense(4), keras.layers.Dense(4)
        self.scale = self.add_weight(shape=(), initializer="zeros", name="scale")

    def call(self, x):
        return self.images(x[:, :3]), self.texts(x[:, 3:])

    def gathered_loss(self, x, training):
        a, b = (towers.gather(part) for part in self(x, training=training))
        a, b = tf.math.l2_normalize(a, 1), tf.math.l2_normalize(b, 1)
        logits = tf.matmul(a, b, transpose_b=True) * tf.exp(self.scale) * 5.0
        pairs = tf.range(tf.shape(logits)[0])
        cross = tf.nn.sparse_softmax_cross_entropy_with_logits
        both = cross(pairs, logits) + cross(pairs, tf.transpose(logits))
        return tf.reduce_mean(both) / 2

    def train_step(self, data):
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        with tf.GradientTape() as tape:
            loss = self.gathered_loss(x, training=True)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}

    def test_step(self, data):
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        return {"loss": self.gathered_loss(x, training=False)}


def build():
    width = 5 if args.model == "wider" and rank == 1 else 4
    if args.model == "gathering":
        model = Gathering()
        model.compile(optimizer=optimizers[args.optimizer]())
        return model
    if args.model in ("twoapplies", "twoapplies_bn"):
        # Its Dropout draws each call: three calls a step, one device's masks.
        hidden = [keras.layers.Dense(8, activation="tanh"),
                  keras.layers.Dropout(0.3, seed=7)]  # fmt: skip
        if args.model == "twoapplies_bn":
            hidden = [keras.layers.Dense(8, use_bias=False),
                      keras.layers.BatchNormalization(momentum=0.5),
                      keras.layers.Activation("tanh")]  # fmt: skip
        model = TwoApplies([keras.Input((6,)), *hidden, keras.layers.Dense(width)])
        model.compile(
            loss=classify,
            optimizer=optimizers[args.optimizer](),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        )
        return model
    if args.model == "unseeded":
        model = Unseeded([keras.Input((6,)), keras.layers.Dense(width)])
        model.compile(loss=classify, optimizer=optimizers[args.optimizer]())
        return model
    if args.model == "clip":
        inputs = keras.Input((6,))
        encoded = [
            keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(part))
            for part in (inputs[:, :3], inputs[:, 3:])
        ]
        model = Clip(inputs, encoded)
        model.compile(optimizer=optimizers[args.optimizer]())
        return model
    if args.outputs == 2:
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        label = keras.layers.Dense(width, name="label")(hidden)
        value = keras.layers.Dense(1, name="value")(hidden)
        return keras.Model(inputs, [label, value])
    if args.model == "bn":
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, use_bias=False),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Activation("tanh"),
                keras.layers.Dense(width),
            ]
        )
    if args.model == "dropout":
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dropout(0.4, seed=5),
                keras.layers.GaussianNoise(0.2, seed=6),
                PairedNoise(),
                keras.layers.Dense(width),
            ]
        )
    if args.model == "moe":
        from keras_hub.src.models.mixtral.mixtral_decoder import MixtralSparseMoeBlock

        inputs = keras.Input((6,))
        tokens = keras.layers.Reshape((2, 4))(keras.layers.Dense(8)(inputs))
        block = MixtralSparseMoeBlock(4, 8, num_experts=4, router_aux_loss_coef=0.5)
        mixed, _ = block(tokens)
        outputs = keras.layers.Dense(width)(keras.layers.Flatten()(mixed))
        return keras.Model(inputs, outputs)
    return keras.Sequential(
        [
            keras.Input((6,)),
            Seen(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(width),
        ]
    )


classify = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
losses = {"label": classify, "value": "mse"} if args.outputs == 2 else classify


optimizers = {
    # epsilon: see tests/tolerances.py (ADAM_EPSILON).
    "adam": lambda: keras.optimizers.Adam(0.05, epsilon=1e-3),
    "sgd": lambda: keras.optimizers.SGD(0.1),
}
own = args.model in (
    "clip",
    "unseeded",
    "twoapplies",
    "twoapplies_bn",
    "gathering",
)  # compiled in build()
engine = towers.Towers(
    build,
    *(() if own else (losses, optimizers[args.optimizer])),
    devices=devices,
    loss_weights={"label": 1.0, "value": 0.3} if args.outputs == 2 else None,
    metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")]
    if args.outputs == 1 and not own
    else None,
    cluster=cluster,
    accumulate_steps=args.accumulate,
    on_nonfinite=args.nonfinite,
    batch_statistics=args.batch_statistics,
    jit_compile=args.jit_compile,
    steps_per_execution=args.steps_per_execution,
)
# The variables every worker starts from (the chief's, after the engine's start).
start = [v.numpy() for v in engine.model.variables]
# Same data on every worker and in the reference; each worker takes its share.
data = np.random.default_rng(7)
x = data.normal(size=(64, 6)).astype("float32")
y = data.integers(0, 4, size=64).astype("int64")
sample_weight = data.random(64).astype("float32")
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


class Announce(keras.callbacks.Callback):
    """--slow: each step said and stretched, so a signal lands mid-training."""

    def on_train_batch_end(self, batch, logs=None):
        print(f"worker {rank} trained step {engine.steps_done}", flush=True)
        time.sleep(0.3)


def targets(rows):
    if args.outputs == 2:
        return {"label": y[rows], "value": x[rows, :1] * 2.0}
    return y[rows]


if args.mode == "steps":
    target_spec = (
        {
            "label": tf.TensorSpec((None,), tf.int64),
            "value": tf.TensorSpec((None, 1), tf.float32),
        }
        if args.outputs == 2
        else tf.TensorSpec((None,), tf.int64)
    )
    spec = (tf.TensorSpec((None, 6), tf.float32), target_spec)
    if args.weighted:
        spec = (*spec, tf.TensorSpec((None,), tf.float32))

    def global_batches():
        for a, b in zip(starts, starts[1:]):
            rows = slice(a, b)
            batch = (x[rows], targets(rows))
            yield (*batch, sample_weight[rows]) if args.weighted else batch

    batches = tf.data.Dataset.from_generator(global_batches, output_signature=spec)
    step_losses, errors = [], []
    for batch in towers.shard(batches, cluster):
        try:
            logs = engine.train_step(*batch)
        except FloatingPointError as error:
            errors.append(str(error))
            continue
        step_losses.append(float(logs["loss"]))
    result["losses"] = step_losses
    result["errors"] = errors
    result["iterations"] = int(engine.optimizer.iterations.numpy())
    if hasattr(engine.optimizer, "dynamic_scale"):
        result["scale"] = float(engine.optimizer.dynamic_scale.numpy())
    if "acc" in engine.get_metrics_result():
        result["acc"] = engine.get_metrics_result()["acc"]
    parts = (x, targets(slice(None)))
    if args.weighted:
        parts = (*parts, sample_weight)
    evaluation = towers.shard(tf.data.Dataset.from_tensor_slices(parts).batch(9))
    result["evaluate"] = engine.evaluate(evaluation, verbose=0, return_dict=True)
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
    # Reshuffled every epoch: a relaunch must resume at the chief's data position.
    # A shuffle's order depends on the global seed too: the same on every worker
    # (the models' initial values above differ on purpose).
    tf.random.set_seed(3)
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    rows = rows.shuffle(len(x), seed=3, reshuffle_each_iteration=True)
    train = towers.shard(rows.batch(10), cluster)
    valid = towers.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(25), cluster)
    history = engine.fit(
        train,
        epochs=args.epochs,
        validation_data=valid,
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.every,
        callbacks=[DieAt()] if args.die_at else [Announce()] if args.slow else None,
        verbose=1,
    )
    result["history"] = history.history
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

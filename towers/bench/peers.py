"""What towers is measured against: the same model, batch and devices, as a peer
would train them. Each returns a zero-arg step that trains once on ``(x, y)``.

Every step takes the batch as its compiled function's arguments, as a training
loop must (the batch changes every step), never as captured constants: passing a
batch costs each of them, towers included, about 3 % on the MLP preset here.

- :func:`single_device_step`: the textbook step on one device, whole batch. Every
  ``vs 1 dev`` ratio is against it.
- :func:`floor_step`: the zero-sync floor: the same shards, a model copy per tower
  device, each applying its own gradients, nothing combined (``Towers``'
  ``placement="independent"``). Every ``vs floor`` ratio is against it: what
  splitting the batch costs on this machine before any gradient moves.
- :func:`naive_step`: the TF1 multi-GPU tutorials' loop: variables on the CPU,
  each tower's mean loss, and ``average_gradients`` (an ``add_n`` per variable,
  divided by T) on the CPU.
- :func:`strategy_step`: ``MirroredStrategy`` or ``CentralStorageStrategy`` in a
  custom loop, as their guides write it.
- :func:`multi_worker_step`: ``MultiWorkerMirroredStrategy``'s custom loop, one
  worker's part (``towers bench --workers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.engine import Towers
from towers.split import split_sizes

Step = Callable[[], Any]


def single_device_step(build, loss_fn, device: str, jit_compile: bool = False):
    """The textbook step: one device, whole batch, one tf.function ``step(x, y)``
    (with ``jit_compile``, one XLA computation, as Keras' fit compiles it)."""
    with tf.device(device):
        model = build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.device(device):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    return step


def floor_step(preset, devices: Sequence[str], x, y, jit_compile=False) -> Step:
    """The zero-sync floor: ``Towers(placement="independent")`` on the same shards
    (with ``jit_compile``, each copy's pass one XLA computation)."""
    engine = Towers(
        preset.build,
        preset.loss(),
        lambda: keras.optimizers.SGD(0.01),
        devices=list(devices),
        placement="independent",
        jit_compile=jit_compile,
    )
    return lambda: engine.train_step(x, y)["loss"]


def naive_step(preset, devices: Sequence[str], x, y) -> Step:
    """The TF1 tutorials' multi-GPU loop, in a tf.function: shared variables on
    the CPU, each tower's mean loss on its shard, ``average_gradients`` on the
    CPU (``tf.add_n`` per variable, then ``/ T``), one apply."""
    with tf.device("/cpu:0"):
        model = preset.build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    loss_fn = preset.loss()
    num = len(devices)

    @tf.function
    def step(x, y):
        xs, ys = tf.split(x, num), tf.split(y, num)
        tower_grads, losses = [], []
        for t, device in enumerate(devices):
            with tf.device(device):
                with tf.GradientTape() as tape:
                    loss = loss_fn(ys[t], model(xs[t], training=True))
                tower_grads.append(tape.gradient(loss, model.trainable_variables))
                losses.append(loss)
        with tf.device("/cpu:0"):
            grads = [tf.add_n(list(g)) / num for g in zip(*tower_grads)]
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.add_n(losses) / num

    return lambda: step(x, y)


def strategy_step(kind: str, preset, devices: Sequence[str], x, y) -> Step:
    """The same model and batch under a tf.distribute strategy's custom loop: the
    global batch goes in, each replica takes its slice on the host (the first
    ``B % T`` one example more, as towers splits) and trains on its device."""
    if kind == "mirrored":
        strategy = tf.distribute.MirroredStrategy(list(devices))
    else:
        strategy = tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=list(devices), parameter_device="/cpu:0"
        )
    global_batch = int(x.shape[0])
    train, _ = _replica_training(strategy, preset, global_batch)
    bounds = [0, *np.cumsum(split_sizes(global_batch, len(devices)))]

    @tf.function
    def step(x, y):
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            replica = int(tf.get_static_value(replica))  # one trace per replica
            with tf.device("/cpu:0"):
                rows = slice(int(bounds[replica]), int(bounds[replica + 1]))
                x_r, y_r = x[rows], y[rows]
            return train(x_r, y_r)

        losses = strategy.run(replica_step)
        return strategy.reduce("SUM", losses, axis=None)

    return lambda: step(x, y)


def multi_worker_step(strategy, preset, x, y, global_batch: int) -> tuple[Step, Any]:
    """``MultiWorkerMirroredStrategy``'s custom loop, as its guide writes it: this
    worker's rows ``(x, y)`` of a global batch of ``global_batch``, the loss
    averaged over the global batch, the strategy's all-reduce inside
    ``apply_gradients``. ``strategy`` is made by the caller (it starts the
    collective runtime from ``TF_CONFIG``, or joins the one ``Towers`` started).
    BatchNormalization layers are ``synchronized``: the whole global batch's
    statistics, as towers' cluster engine takes them (``batch_statistics=
    "global"``). Returns the step and the model."""
    train, model = _replica_training(strategy, preset, global_batch, synchronized=True)

    @tf.function
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(train, (x, y)), axis=None)

    return (lambda: step(x, y)), model


def _replica_training(strategy, preset, global_batch: int, synchronized=False):
    """The model and optimizer in ``strategy``'s scope, and one replica's step
    as the strategies' guides write it: the per-example loss averaged over the
    global batch, ``apply_gradients`` (which all-reduces). ``synchronized``:
    BatchNormalization layers all-reduce their statistics over the replicas.
    ``(train, model)``."""
    with strategy.scope():
        model = preset.build()
        for layer in model._flatten_layers():
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = synchronized
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    per_example = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none"
    )

    def train(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example(y, model(x, training=True)),
                global_batch_size=global_batch,
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train, model

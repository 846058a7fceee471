"""The CIFAR-10 multi-GPU tutorial's towers, in TF2 with towers.

The TF1 tutorial (tensorflow/models, tutorials/image/cifar10/cifar10_multi_gpu_train.py)
kept every variable on the CPU (``_variable_on_cpu``), built one tower per GPU under
``tf.name_scope('tower_%d')`` with ``reuse_variables()``, had each tower compute
``opt.compute_gradients(loss)`` on its own batch, then averaged them::

    def average_gradients(tower_grads):
      average_grads = []
      for grad_and_vars in zip(*tower_grads):
        grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
        grad = tf.reduce_mean(tf.concat(axis=0, values=grads), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
      return average_grads

and applied the average once. What went wrong when people reused it:

- Each tower's loss was the mean over *its own* batch, and the towers were
  averaged: right only when every tower has the same number of examples. A last,
  smaller batch split unevenly gives a different (wrong) gradient.
- ``tf.expand_dims(None, 0)`` fails: a variable a tower does not use (an unused
  head, a frozen branch) crashes the average.
- An embedding's gradient is ``IndexedSlices``; ``expand_dims`` and ``concat``
  turn it into a dense ``[vocab, dim]`` tensor per tower.
- Ported to TF2, the loop is often written with ``optimizer.apply_gradients``
  inside the tower loop: the optimizer steps once per tower, its iteration count
  runs N times too fast and Adam's moments see N small steps instead of one.

towers: the variables live on the variable device as in the tutorial, each tower's
loss is divided by the *global* batch so the towers' gradients sum to the whole
batch's, ``None`` counts as zero in the towers that lack it, slices stay slices, and
the optimizer is applied once. Run: ``python examples/cifar10_average_gradients.py``.
``--verbose`` keeps TensorFlow's start-up lines.
"""

import sys

import towers
from towers.commands import start_tensorflow

start_tensorflow(verbose="--verbose" in sys.argv)  # its start-up lines, if asked
DEVICES = towers.virtual_devices(2)  # two "GPUs"; before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def build_cnn():
    """A small CIFAR-shaped CNN: x f32[B, 16, 16, 3] -> logits f32[B, 10]."""
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def average_gradients(tower_grads):
    """The tutorial's function, unchanged but for TF2 spelling."""
    average_grads = []
    for grad_and_vars in zip(*tower_grads):
        grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
        grad = tf.reduce_mean(tf.concat(grads, axis=0), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
    return average_grads


def tutorial_gradients(model, loss_fn, shards):
    """Each tower: the mean loss over its own shard, gradients as (grad, var)."""
    tower_grads = []
    for device, (x_t, y_t) in zip(DEVICES, shards):
        with tf.device(device), tf.GradientTape() as tape:
            loss = loss_fn(y_t, model(x_t))
        grads = tape.gradient(loss, model.trainable_variables)
        tower_grads.append(list(zip(grads, model.trainable_variables)))
    return tower_grads


def main():
    rng = np.random.default_rng(0)
    x = rng.random((7, 16, 16, 3), dtype=np.float32)  # 7 examples: an uneven split
    y = rng.integers(0, 10, 7).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    model = build_cnn()
    start = model.get_weights()

    # One device on the whole batch: the reference.
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    reference = tape.gradient(loss, model.trainable_variables)

    # The tutorial's towers on shards of 4 and 3: the average of the means is off.
    shards = towers.split_batch((x, y), 2)
    averaged = average_gradients(tutorial_gradients(model, loss_fn, shards))
    error = max(
        float(np.max(np.abs(g.numpy() - r.numpy())))
        for (g, _), r in zip(averaged, reference)
    )
    print(
        f"tutorial average_gradients on shards {towers.split_sizes(7, 2)}: "
        f"off by up to {error:.2e} from one device"
    )
    assert error > 1e-4

    # A variable tower 1 did not use: its gradient is None and expand_dims fails.
    pairs = tutorial_gradients(model, loss_fn, shards)
    pairs[1][-1] = (None, pairs[1][-1][1])
    try:
        average_gradients(pairs)
        raise AssertionError("average_gradients took a None gradient")
    except (ValueError, TypeError) as error:
        print(
            f"tutorial average_gradients with a None gradient: {type(error).__name__}"
        )
    combined = towers.combine_gradients(pairs, reduction="mean")
    print(
        f"towers.combine_gradients with the same None: bias grad shape "
        f"{tuple(combined[-1][0].shape)} (tower 1 counted as zero)"
    )

    # The optimizer stepped per tower (a frequent TF2 port): two iterations.
    optimizer = keras.optimizers.Adam(1e-2)
    for tower_pairs in tutorial_gradients(model, loss_fn, shards):
        optimizer.apply_gradients(tower_pairs)
    print(
        f"apply_gradients per tower: optimizer.iterations = "
        f"{int(optimizer.iterations.numpy())} after one step"
    )
    model.set_weights(start)

    # towers: the same model, variables on the CPU, one apply per step.
    def build():
        m = build_cnn()
        m.set_weights(start)
        return m

    engine = towers.Towers(
        build,
        loss_fn,
        lambda: keras.optimizers.Adam(1e-2),
        devices=DEVICES,
        variable_device="/cpu:0",
    )
    engine.train_step(x, y)
    one = keras.optimizers.Adam(1e-2)
    one.apply_gradients(zip(reference, model.trainable_variables))
    for got, want in zip(engine.model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print(
        f"towers: optimizer.iterations = {int(engine.optimizer.iterations)}; "
        "weights after one step: towers matches one device (rtol 1e-5)"
    )


if __name__ == "__main__":
    main()

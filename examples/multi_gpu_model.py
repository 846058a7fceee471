"""Keras ``multi_gpu_model``'s "template on the CPU, replicas on the GPUs", with towers.

``keras.utils.multi_gpu_model`` (removed in TensorFlow 2.4) built the model once
under ``/cpu:0`` (the template, which owned the weights), then wrapped it: for
each GPU a slice of the batch went through the template on that GPU, and the
outputs were concatenated back on the CPU, where the loss was computed. The math
was right (autodiff summed each weight's gradient across the replicas and the
optimizer stepped once), but:

- Slices were ``batch // n`` with the remainder on the last GPU: a batch of 7 on
  4 GPUs ran as 1, 1, 1, 4, and a batch smaller than the GPU count ran entirely
  on the last one.
- The loss and its first gradients ran on the concatenated outputs on the CPU;
  where each weight's gradients were summed was left to TensorFlow's placer.
- You had to save the template, not the parallel model, and BatchNormalization
  in the template kept per-slice statistics.

towers keeps the template's good idea (weights on one variable device, replicas
that read them) and makes the rest explicit: even shards, each tower's loss on its
own device, one combine on the variable device, one apply — and
``Towers.explain`` shows where each part ran.
Run: ``python examples/multi_gpu_model.py``.
``--verbose`` keeps TensorFlow's start-up lines.
"""

import sys

import towers
from towers.commands import start_tensorflow

start_tensorflow(verbose="--verbose" in sys.argv)  # its start-up lines, if asked
DEVICES = towers.virtual_devices(4)  # four "GPUs"; before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def slice_sizes(batch, parts):
    """multi_gpu_model's get_slice: ``batch // parts`` each, the rest to the last."""
    step = batch // parts
    return [step] * (parts - 1) + [batch - step * (parts - 1)]


class MultiGpuModel(keras.Model):
    """multi_gpu_model as TF2 code: the template run on each device's slice."""

    def __init__(self, template, devices):
        super().__init__()
        self.template, self.gpus = template, devices

    def call(self, x):
        outputs, start = [], 0
        for device, size in zip(self.gpus, slice_sizes(x.shape[0], len(self.gpus))):
            with tf.device(device):
                outputs.append(self.template(x[start : start + size]))
            start += size
        with tf.device("/cpu:0"):  # merged on the CPU, where the loss runs
            return tf.concat(outputs, axis=0)


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def sgd_step(model, x, y):
    """One step, the loss on the whole (merged) output, one apply."""
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    model.optimizer.apply_gradients(zip(grads, model.trainable_variables))


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 8)).astype("float32")
    y = rng.standard_normal((7, 1)).astype("float32")
    print(
        f"multi_gpu_model slices of 7 on 4 GPUs: {slice_sizes(7, 4)}; "
        f"towers shards: {towers.split_sizes(7, 4)}"
    )
    print(
        f"multi_gpu_model slices of 3 on 4 GPUs: {slice_sizes(3, 4)}; "
        f"towers shards: {towers.split_sizes(3, 4)}"
    )

    with tf.device("/cpu:0"):
        template = build()
        parallel = MultiGpuModel(template, DEVICES)
        parallel.optimizer = keras.optimizers.SGD(0.05)
    tf.function(sgd_step)(parallel, x, y)

    reference = build()
    reference.optimizer = keras.optimizers.SGD(0.05)
    sgd_step(reference, x, y)

    engine = towers.Towers(
        build,
        "mse",
        lambda: keras.optimizers.SGD(0.05),
        devices=DEVICES,
        variable_device="/cpu:0",
    )
    report = engine.explain(x, y)  # before training: explain leaves it as it was
    engine.train_step(x, y)
    for got, old, want in zip(
        engine.model.get_weights(), template.get_weights(), reference.get_weights()
    ):
        np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print(
        "one SGD step: multi_gpu_model matches one device, and towers matches "
        "one device (rtol 1e-5)"
    )
    for t in range(4):
        print(f"  tower {t}: backward on {report.ran_on(f'tower {t} backward')[0]}")
    print(f"  combine on {report.ran_on('combine')}, apply on {report.ran_on('apply')}")


if __name__ == "__main__":
    main()

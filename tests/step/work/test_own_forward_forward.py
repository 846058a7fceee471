"""keras.io's forward-forward example, as its author wrote it: a model with
no ``call()``, its own ``train_step`` decorated ``tf.function(jit_compile=
True)`` and compiled with ``jit_compile=True``, each layer trained by an
optimizer of its own inside the step. Keras' fit trains it; so must towers,
to the same weights (float64; the example's negative labels are drawn with
TensorFlow's stateful shuffle, here a shift of the labels, one device's
anywhere)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class FFDense(keras.layers.Layer):
    """The example's layer: a Dense on normalised inputs, trained on its own
    goodness for ``epochs`` applies a step."""

    def __init__(self, units, optimizer, epochs=2, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)
        self.optimizer, self.epochs, self.threshold = optimizer, epochs, 1.5

    def call(self, x):
        norm = tf.norm(x, ord=2, axis=1, keepdims=True) + 1e-4
        return tf.nn.relu(self.dense(x / norm))

    def forward_forward(self, x_pos, x_neg):
        for _ in range(self.epochs):
            with tf.GradientTape() as tape:
                g_pos = tf.reduce_mean(tf.pow(self.call(x_pos), 2), 1)
                g_neg = tf.reduce_mean(tf.pow(self.call(x_neg), 2), 1)
                margins = tf.concat(
                    [-g_pos + self.threshold, g_neg - self.threshold], 0
                )
                loss = tf.reduce_mean(tf.math.log(1 + tf.exp(margins)))
            grads = tape.gradient(loss, self.dense.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.dense.trainable_weights))
        return (
            tf.stop_gradient(self.call(x_pos)),
            tf.stop_gradient(self.call(x_neg)),
            loss,
        )


class FFNetwork(keras.Model):
    """No call(): only its own train_step, as XLA, runs its layers."""

    def __init__(self, dims, **kwargs):
        super().__init__(**kwargs)
        self.layer_optimizer = keras.optimizers.Adam(learning_rate=0.03)
        self.loss_sum = tf.Variable(0.0, trainable=False, dtype=tf.float64)
        self.loss_count = tf.Variable(0.0, trainable=False, dtype=tf.float64)
        self.blocks = [FFDense(dims[1], self.layer_optimizer)]

    def overlay(self, x, labels):
        # The label's one-hot on the first ten inputs, as the example does.
        return tf.concat([tf.one_hot(labels, 10, dtype=x.dtype), x[:, 10:]], 1)

    @tf.function(jit_compile=True)
    def train_step(self, data):
        x, y = data
        x = tf.reshape(x, [-1, tf.shape(x)[1] * tf.shape(x)[2]])
        h_pos, h_neg = self.overlay(x, y), self.overlay(x, (y + 1) % 10)
        for block in self.blocks:
            h_pos, h_neg, loss = block.forward_forward(h_pos, h_neg)
            self.loss_sum.assign_add(tf.cast(loss, tf.float64))
            self.loss_count.assign_add(1.0)
        return {"FinalLoss": self.loss_sum / self.loss_count}


def network():
    keras.utils.set_random_seed(3)
    model = FFNetwork(dims=[36, 12])
    model.compile(optimizer=keras.optimizers.Adam(0.03), loss="mse", jit_compile=True)
    return model


def test_keras_ios_forward_forward_trains_on_towers_as_keras_fit():
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 6, 6)), rng.integers(0, 10, 16)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model, reference = network(), network()
    # Built as the first step builds them, then the same starting weights.
    engine = Towers(model, devices=devices(2))
    with pytest.warns(UserWarning, match="runs without XLA"):
        got = engine.fit(data, epochs=2, verbose=0)
    want = reference.fit(data, epochs=2, verbose=0)
    assert len(got.history["FinalLoss"]) == len(want.history["FinalLoss"]) == 2
    # The loss it reports reads two raw tf.Variables its step adds to (the
    # layer's loss, a count), which Keras' model.variables does not hold:
    # each added to once a step, the loss as one device's on the batch.
    np.testing.assert_allclose(
        got.history["FinalLoss"], want.history["FinalLoss"], rtol=1e-10
    )
    for raw in ("loss_sum", "loss_count"):
        mine, theirs = getattr(model, raw).numpy(), getattr(reference, raw).numpy()
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, err_msg=raw)
    # The weights and the layer's optimizer: one device's.
    for mine, theirs in zip(
        model.variables + model.layer_optimizer.variables,
        reference.variables + reference.layer_optimizer.variables,
    ):
        np.testing.assert_allclose(
            mine.numpy(), theirs.numpy(), rtol=1e-10, atol=1e-12, err_msg=mine.path
        )

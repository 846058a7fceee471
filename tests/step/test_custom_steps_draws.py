"""Random draws in a model's own train_step, written as keras.io's examples
write them, are one device's numbers for each tower's examples
(towers/step/draws.py): against Keras' fit on one device, float64, uneven
shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.test_custom_steps import FLOAT64_ATOL, FLOAT64_RTOL, GAN, gan
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class ShapeGAN(GAN):
    """The fit guide's GAN reads its batch size with ``tf.shape``."""

    def rows_of(self, real):
        return tf.shape(real)[0]


def assert_trains_as_keras_fit(build, num_towers, data):
    engine = Towers(build(), devices=devices(num_towers))
    reference = build()
    before = [v.numpy() for v in reference.variables]
    run = dict(batch_size=8, epochs=2, verbose=0, shuffle=False)
    history = engine.fit(data, **run)
    expected = reference.fit(data, **run)
    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=FLOAT64_RTOL,
            atol=FLOAT64_ATOL, err_msg=want.path,
        )  # fmt: skip
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=FLOAT64_RTOL)


@pytest.mark.parametrize("num_towers", [2, 3])
def test_latents_shaped_by_tf_shape_are_one_devices(num_towers):
    real = np.random.default_rng(0).standard_normal((29, 2))
    assert_trains_as_keras_fit(lambda: gan(True, ShapeGAN), num_towers, real)


class NoisyCritic(keras.Model):
    """WGAN-GP's penalty as keras.io writes it: the interpolation weights
    drawn with TensorFlow's stateful ``tf.random.uniform``."""

    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(4, activation="tanh"),
             keras.layers.Dense(1)]
        )  # fmt: skip

    def call(self, x):
        return self.critic(x)

    def train_step(self, data):
        real, fake = data
        alpha = tf.random.uniform([tf.shape(real)[0], 1], 0.0, 1.0, real.dtype)
        mixed = real + alpha * (fake - real)
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(mixed)
                scores = self.critic(mixed, training=True)
            norms = tf.norm(inner.gradient(scores, mixed), axis=1)
            penalty = tf.reduce_mean((norms - 1.0) ** 2)
            cost = tf.reduce_mean(self.critic(fake)) - tf.reduce_mean(self.critic(real))
            loss = cost + 10.0 * penalty
        variables = self.critic.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def test_tensorflows_stateful_draws_are_named_not_silent(recwarn):
    keras.utils.set_random_seed(0)
    model = NoisyCritic()
    model.compile(keras.optimizers.SGD(0.01))
    model(np.zeros((1, 2)))
    rng = np.random.default_rng(0)
    real, fake = rng.standard_normal((12, 2)), rng.standard_normal((12, 2))
    before = [v.numpy() for v in model.trainable_variables]

    Towers(model, devices=devices(3)).fit(real, fake, batch_size=6, verbose=0)

    named = [str(w.message) for w in recwarn if "random_uniform" in str(w.message)]
    assert len(named) == 1 and "each tower draws its own numbers" in named[0]
    moved = [
        np.abs(v.numpy() - b).max() for v, b in zip(model.trainable_variables, before)
    ]
    assert all(np.isfinite(moved)) and max(moved) > 0

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


class Denoiser(keras.Model):
    """keras.io's DDIM step, reduced: images without targets, noise drawn per
    image, the compiled loss called by the step itself on the noise."""

    def __init__(self, fixed_batch=None):
        super().__init__()
        self.fixed_batch = fixed_batch
        self.network = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(5, activation="tanh"),
             keras.layers.Dense(3)]
        )  # fmt: skip
        self.noise_loss = keras.metrics.Mean(name="n_loss")
        self.seed_generator = keras.random.SeedGenerator(5)

    @property
    def metrics(self):
        return [self.noise_loss]

    def call(self, images):
        return self.network(images)

    def train_step(self, images):
        rows = self.fixed_batch or keras.ops.shape(images)[0]
        noises = keras.random.normal(
            (rows, 3), seed=self.seed_generator, dtype=images.dtype
        )
        with tf.GradientTape() as tape:
            predicted = self.network(images + 0.5 * noises, training=True)
            loss = self.loss(noises, predicted)
        variables = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.noise_loss.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


def denoiser(fixed_batch=None):
    keras.utils.set_random_seed(2)
    model = Denoiser(fixed_batch)
    model.compile(keras.optimizers.Adam(0.01), loss=keras.losses.mean_absolute_error)
    model(np.zeros((1, 3)))
    return model


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_step_calling_the_compiled_loss_on_images_alone_trains_as_keras(num_towers):
    images = np.random.default_rng(1).standard_normal((29, 3))
    assert_trains_as_keras_fit(denoiser, num_towers, images)


def test_a_step_shaped_by_a_fixed_batch_size_is_refused_by_name():
    model = denoiser(fixed_batch=8)
    before = [v.numpy() for v in model.variables]
    images = np.random.default_rng(1).standard_normal((24, 3))
    with pytest.raises(ValueError, match="Denoiser.train_step.*fixed batch size"):
        Towers(model, devices=devices(3)).fit(images, batch_size=8, verbose=0)
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


class NoisyLabelsGAN(GAN):
    """The fit guide's GAN: the discriminator sees the fake and real rows
    concatenated, its labels noised by one draw over both (2n rows)."""

    def train_step(self, data):
        real = data
        rows = keras.ops.shape(real)[0]
        z = keras.random.normal((rows, self.latent), seed=self.seed_generator)
        combined = keras.ops.concatenate([self.generator(z), real], axis=0)
        labels = keras.ops.concatenate(
            [keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(
            tf.shape(labels), seed=self.seed_generator, dtype=real.dtype
        )
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        d = self.discriminator
        with tf.GradientTape() as tape:
            d_loss = bce(labels, d(combined, training=True))
        grads = tape.gradient(d_loss, d.trainable_variables)
        self.d_optimizer.apply(grads, d.trainable_variables)
        z = keras.random.normal((rows, self.latent), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fakes = d(self.generator(z, training=True), training=True)
            g_loss = bce(keras.ops.zeros((rows, 1)), fakes)
        variables = self.generator.trainable_variables
        self.g_optimizer.apply(tape.gradient(g_loss, variables), variables)
        self.d_loss.update_state(d_loss)
        self.g_loss.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.parametrize("num_towers", [2, 3])
def test_label_noise_over_the_fake_and_real_rows_is_one_devices(num_towers):
    real = np.random.default_rng(0).standard_normal((29, 2))
    assert_trains_as_keras_fit(lambda: gan(True, NoisyLabelsGAN), num_towers, real)

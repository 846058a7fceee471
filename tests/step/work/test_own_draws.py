"""Random draws in a model's own train_step, written as keras.io's examples
write them, are one device's numbers for each tower's examples
(towers/step/rules/draws.py): against Keras' fit on one device, float64, uneven
shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import FLOAT64_ATOL, FLOAT64_RTOL, GAN, gan
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class ShapeGAN(GAN):
    """The fit guide's GAN reads its batch size with ``tf.shape``."""

    def rows_of(self, real):
        return tf.shape(real)[0]


def assert_trains_as_keras_fit(build, num_towers, data, batch_size=8):
    engine = Towers(build(), devices=devices(num_towers))
    reference = build()
    before = [v.numpy() for v in reference.variables]
    run = dict(batch_size=batch_size, epochs=2, verbose=0, shuffle=False)
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

    said = [str(w.message) for w in recwarn if "random_uniform" in str(w.message)]
    named = [m for m in said if m.startswith("towers: a draw of the step")]
    assert len(named) == 1 and "each tower draws its own numbers" in named[0]
    # The first step's check says it could not compare, naming the draw too.
    assert len(said) == 2 and any("was not compared" in m for m in said), said
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


@pytest.mark.parametrize("num_towers", [2, 3])
def test_noise_over_a_fixed_batch_size_that_is_the_batchs_is_one_devices(num_towers):
    # On 2 towers each has 4 of the 8 rows (8 is also 2 blocks of 4), on 3
    # the last has 2 (4 blocks): a draw given the batch's rows as a number
    # is one device's draw, each tower taking its rows.
    images = np.random.default_rng(1).standard_normal((24, 3))
    assert_trains_as_keras_fit(lambda: denoiser(fixed_batch=8), num_towers, images)


def test_a_fixed_batch_size_other_than_the_batchs_is_refused_by_name():
    model = denoiser(fixed_batch=8)
    before = [v.numpy() for v in model.variables]
    images = np.random.default_rng(1).standard_normal((24, 3))
    with pytest.raises(ValueError, match="Denoiser.train_step.*fixed batch size"):
        Towers(model, devices=devices(3)).fit(images, batch_size=6, verbose=0)
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


@keras.saving.register_keras_serializable(package="tests")
def sinusoidal_embedding(x):
    frequencies = keras.ops.exp(keras.ops.linspace(0.0, 3.0, 2))
    angles = keras.ops.cast(2.0 * np.pi * frequencies, x.dtype) * x
    return keras.ops.concatenate([keras.ops.sin(angles), keras.ops.cos(angles)], -1)


class DDIM(keras.Model):
    """keras.io's DDIM (examples/generative/ddim.py) as written, its U-Net a
    residual block: images normalised by an adapted layer, noise and
    diffusion times drawn from Keras' global seed generator over the fixed
    ``batch_size``, a cosine schedule, the compiled loss on the noise, the
    image loss as a metric, an EMA copy of the network assigned after the
    update."""

    batch_size, size = 6, 4

    def __init__(self):
        super().__init__()
        self.normalizer = keras.layers.Normalization()
        self.network = self.residual_network()
        self.ema_network = keras.models.clone_model(self.network)
        self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")
        self.image_loss_tracker = keras.metrics.Mean(name="i_loss")

    def residual_network(self):
        images = keras.Input((self.size, self.size, 3))
        variances = keras.Input((1, 1, 1))
        embedding = keras.layers.Lambda(sinusoidal_embedding)(variances)
        embedding = keras.layers.UpSampling2D(self.size)(embedding)
        x = keras.layers.Conv2D(4, 1)(images)
        x = keras.layers.Concatenate()([x, embedding])
        residual = keras.layers.Conv2D(4, 1)(x)
        x = keras.layers.BatchNormalization(center=False, scale=False)(x)
        x = keras.layers.Conv2D(4, 3, padding="same", activation="swish")(x)
        x = keras.layers.Add()([x, residual])
        outputs = keras.layers.Conv2D(3, 1, kernel_initializer="zeros")(x)
        return keras.Model([images, variances], outputs)

    @property
    def metrics(self):
        return [self.noise_loss_tracker, self.image_loss_tracker]

    def diffusion_schedule(self, diffusion_times):
        start = keras.ops.cast(keras.ops.arccos(0.95), diffusion_times.dtype)
        end = keras.ops.cast(keras.ops.arccos(0.02), diffusion_times.dtype)
        angles = start + diffusion_times * (end - start)
        return keras.ops.sin(angles), keras.ops.cos(angles)

    def denoise(self, noisy_images, noise_rates, signal_rates, training):
        network = self.network if training else self.ema_network
        pred_noises = network([noisy_images, noise_rates**2], training=training)
        pred_images = (noisy_images - noise_rates * pred_noises) / signal_rates
        return pred_noises, pred_images

    def train_step(self, images):
        images = self.normalizer(images, training=True)
        noises = keras.random.normal(
            shape=(self.batch_size, self.size, self.size, 3), dtype=images.dtype
        )
        diffusion_times = keras.random.uniform(
            shape=(self.batch_size, 1, 1, 1), minval=0.0, maxval=1.0,
            dtype=images.dtype,
        )  # fmt: skip
        noise_rates, signal_rates = self.diffusion_schedule(diffusion_times)
        noisy_images = signal_rates * images + noise_rates * noises
        with tf.GradientTape() as tape:
            pred_noises, pred_images = self.denoise(
                noisy_images, noise_rates, signal_rates, training=True
            )
            noise_loss = self.loss(noises, pred_noises)
            image_loss = self.loss(images, pred_images)
        gradients = tape.gradient(noise_loss, self.network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))
        self.noise_loss_tracker.update_state(noise_loss)
        self.image_loss_tracker.update_state(image_loss)
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(0.9 * ema_weight + 0.1 * weight)
        return {m.name: m.result() for m in self.metrics}


def ddim(images):
    keras.utils.set_random_seed(3)
    model = DDIM()
    model.normalizer.adapt(images)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=0.01, weight_decay=1e-4),
        loss=keras.losses.mean_absolute_error,
    )
    model.network([np.zeros((1, 4, 4, 3)), np.zeros((1, 1, 1, 1))])
    return model


@pytest.mark.parametrize("num_towers", [2, 4])
def test_keras_ios_ddim_as_written_trains_as_keras_fit(num_towers):
    images = np.random.default_rng(2).uniform(size=(18, 4, 4, 3))
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(6, drop_remainder=True)
    engine = Towers(ddim(images), devices=devices(num_towers))
    reference = ddim(images)
    before = [v.numpy() for v in reference.variables]
    keras.utils.set_random_seed(4)  # Keras' global seed generator made anew
    history = engine.fit(dataset, epochs=2, verbose=0)
    keras.utils.set_random_seed(4)
    expected = reference.fit(dataset, epochs=2, verbose=0)
    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=FLOAT64_RTOL,
            atol=FLOAT64_ATOL, err_msg=want.path,
        )  # fmt: skip
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=FLOAT64_RTOL)


class NoisyLabelsGAN(GAN):
    """The fit guide's GAN: the discriminator sees the fake and real rows
    concatenated, its labels noised by one draw over both (2n rows)."""

    shape = staticmethod(tf.shape)  # the guide's: the rows as a tensor

    def train_step(self, data):
        real = data
        rows = keras.ops.shape(real)[0]
        z = keras.random.normal((rows, self.latent), seed=self.seed_generator)
        combined = keras.ops.concatenate([self.generator(z), real], axis=0)
        labels = keras.ops.concatenate(
            [keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(
            self.shape(labels), seed=self.seed_generator, dtype=real.dtype
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


class StaticNoisyLabelsGAN(NoisyLabelsGAN):
    """The same, its label noise shaped by ``keras.ops.shape``: 2n rows as a
    number, on 2 towers of even shards the batch's rows too, read as blocks
    of the shard's, not as one device's draw over the batch (a fixed
    batch_size's, keras.io's DDIM): the probe's parts tell them apart."""

    shape = staticmethod(keras.ops.shape)


# Batches of 4 (2 rows a tower): the probe's two examples draw 4 rows, the
# batch's too, and it reads them as blocks after the other reading misfits.
@pytest.mark.parametrize("batch_size", [8, 4])
def test_label_noise_over_a_number_of_rows_that_is_the_batchs_is_one_devices(
    batch_size,
):
    real = np.random.default_rng(0).standard_normal((29, 2))
    build = lambda: gan(True, StaticNoisyLabelsGAN)  # noqa: E731
    assert_trains_as_keras_fit(build, 2, real, batch_size)

"""A model's own train_step takes its data as Keras' fit hands it: any nest,
its parts of different batch sizes (keras.io's semi-supervised SimCLR zips an
unlabeled and a labeled dataset), each split in the same shares
(towers/split.py). Against Keras' fit on one device, float64, uneven shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import FLOAT64_ATOL, FLOAT64_RTOL
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py

RNG = np.random.default_rng(0)
UNLABELED, LABELED = RNG.standard_normal((40, 4)), RNG.standard_normal((10, 4))
LABELS = RNG.integers(0, 3, 10)


class SemiSupervised(keras.Model):
    """An encoder trained on both parts to reconstruct them (with noise per
    unlabeled row and a scale per labeled row, keras.random over each part's
    rows), and a probe on the labeled part alone, each with its optimizer."""

    def __init__(self, noise_over_both=False):
        super().__init__()
        self.encoder = keras.Sequential(
            [keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(6)]
        )
        self.decoder, self.probe = keras.layers.Dense(4), keras.layers.Dense(3)
        self.seeds = keras.random.SeedGenerator(3)
        self.noise_over_both = noise_over_both

    def compile(self, encoder_optimizer, probe_optimizer):
        super().compile()
        self.encoder_optimizer, self.probe_optimizer = (
            encoder_optimizer,
            probe_optimizer,
        )
        self.trackers = [
            keras.metrics.Mean(name="u_loss"),
            keras.metrics.Mean(name="p_loss"),
        ]
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

    @property
    def metrics(self):
        return [*self.trackers, self.accuracy]

    def call(self, x):
        return self.probe(self.encoder(x))

    def train_step(self, data):
        (unlabeled, _), (labeled, labels) = data
        dtype = unlabeled.dtype
        unlabeled += 0.1 * keras.random.normal(
            tf.shape(unlabeled), seed=self.seeds, dtype=dtype
        )
        scale = keras.random.uniform(
            (tf.shape(labeled)[0], 1), seed=self.seeds, dtype=dtype
        )
        images = tf.concat((unlabeled, labeled * scale), axis=0)
        if self.noise_over_both:
            images += keras.random.normal(
                tf.shape(images), seed=self.seeds, dtype=dtype
            )
        with tf.GradientTape() as tape:
            rebuilt = self.decoder(self.encoder(images, training=True))
            loss = keras.ops.mean(keras.ops.square(rebuilt - images))
        variables = self.encoder.trainable_weights + self.decoder.trainable_weights
        self.encoder_optimizer.apply(tape.gradient(loss, variables), variables)
        with tf.GradientTape() as tape:
            logits = self.probe(self.encoder(labeled))
            probe_loss = keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True
                )
            )
        variables = self.probe.trainable_weights
        self.probe_optimizer.apply(tape.gradient(probe_loss, variables), variables)
        self.trackers[0].update_state(loss)
        self.trackers[1].update_state(probe_loss)
        self.accuracy.update_state(labels, logits)
        return {m.name: m.result() for m in self.metrics}


def semi_supervised(noise_over_both=False):
    keras.utils.set_random_seed(1)
    model = SemiSupervised(noise_over_both)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1))
    return model  # its layers built as its step first runs, in Keras' fit too


def initial_values():
    """``semi_supervised()``'s variables as built, before any step."""
    model = semi_supervised()
    model.encoder.build((None, 4))
    model.decoder.build((None, 6))
    model.probe.build((None, 6))
    return [v.numpy() for v in model.variables]


def zipped(unlabeled_batch, labeled_batch):
    unlabeled = tf.data.Dataset.from_tensor_slices((UNLABELED, np.zeros(40)))
    labeled = tf.data.Dataset.from_tensor_slices((LABELED, LABELS))
    return tf.data.Dataset.zip(
        (unlabeled.batch(unlabeled_batch), labeled.batch(labeled_batch))
    )


# (unlabeled, labeled) batch sizes: 3 batches each; the last of 16 and 4 is 8
# and 2, of 10 and 4 is 10 and 2; 8 and 3 share no divisor (one tower).
@pytest.mark.parametrize("batches", [(16, 4), (10, 4), (8, 3)])
def test_a_zip_of_datasets_batched_apart_trains_as_keras_fit(batches):
    engine = Towers(semi_supervised(), devices=devices(3))
    reference = semi_supervised()

    history = engine.fit(zipped(*batches), epochs=2, verbose=0)
    expected = reference.fit(zipped(*batches), epochs=2, verbose=0)

    before = initial_values()  # each built as its step first ran
    assert len(before) == len(reference.variables) == len(engine.model.variables)
    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=FLOAT64_RTOL,
            atol=FLOAT64_ATOL, err_msg=want.path,
        )  # fmt: skip
    assert history.history.keys() == expected.history.keys()
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=FLOAT64_RTOL)


def test_a_draw_over_rows_of_both_parts_is_named():
    engine = Towers(semi_supervised(noise_over_both=True), devices=devices(2))

    with pytest.warns(UserWarning, match=r"rows of more than one part") as warned:
        engine.fit(zipped(16, 4), epochs=1, verbose=0)

    named = [w for w in warned if "rows of more than one part" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in named]


def test_the_built_in_step_still_refuses_x_and_y_of_different_sizes():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    engine = Towers(model, devices=devices(2))
    before = [v.numpy() for v in model.variables]

    x = tf.data.Dataset.from_tensor_slices(np.zeros((12, 4))).batch(6)
    y = tf.data.Dataset.from_tensor_slices(np.zeros((8, 1))).batch(4)

    with pytest.raises(ValueError, match=r"x and y must have the same batch size"):
        engine.fit(tf.data.Dataset.zip((x, y)), verbose=0)

    for got, want in zip(model.variables, before):
        np.testing.assert_array_equal(got.numpy(), want)


class Contrastive(keras.Model):
    """Semi-supervised SimCLR's step in small: both parts' images, each seen
    twice through an augmentation drawn by TensorFlow's stateful
    ``tf.random.uniform``, and an InfoNCE loss over the batch's pairs."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.layers.Dense(6, activation="tanh")])

    def call(self, x):
        return self.encoder(x)

    def augment(self, images):
        brightness = tf.random.uniform((tf.shape(images)[0], 1), 0.5, 1.5, images.dtype)
        return images * brightness

    def train_step(self, data):
        (unlabeled, _), (labeled, _) = data
        images = tf.concat((unlabeled, labeled), axis=0)
        with tf.GradientTape() as tape:
            first = tf.math.l2_normalize(self.encoder(self.augment(images)), axis=1)
            second = tf.math.l2_normalize(self.encoder(self.augment(images)), axis=1)
            similarities = tf.matmul(first, second, transpose_b=True) / 0.1
            pairs = tf.range(tf.shape(first)[0])
            loss = keras.losses.sparse_categorical_crossentropy(
                pairs, similarities, from_logits=True
            )
        variables = self.encoder.trainable_weights
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"c_loss": keras.ops.mean(loss)}


def test_a_contrastive_loss_behind_stateful_draws_is_refused_by_name():
    keras.utils.set_random_seed(2)
    model = Contrastive()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    model(UNLABELED[:1])
    before = [v.numpy() for v in model.variables]
    engine = Towers(model, devices=devices(2))

    with pytest.raises(ValueError, match=r"neither a mean nor a sum over the examples"):
        with pytest.warns(UserWarning, match=r"stateful random_uniform"):
            engine.fit(zipped(16, 4), epochs=1, verbose=0)

    for got, want in zip(model.variables, before):
        np.testing.assert_array_equal(got.numpy(), want)

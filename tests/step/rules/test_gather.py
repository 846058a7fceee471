"""towers.gather inside a model's own train_step: a contrastive loss over the
whole batch's similarity matrix (SimCLR's, computed in the step, not in
compute_loss) trains to Keras' own fit's weights on one device, where gather
returns its tensor as it is (towers/step/rules/gather.py). Float64, uneven shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.step.work.test_own import assert_same_updates
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class ContrastiveStep(keras.Model):
    """Two views of each example (the first and last 3 features) encoded by
    one encoder; the loss is the symmetric cross-entropy of the batch's
    similarity matrix, sharpened by a learned temperature."""

    def __init__(self, gathered=True, regularised=False, summed=False):
        super().__init__()
        self.reduce = tf.reduce_sum if summed else tf.reduce_mean
        self.gathered = gathered
        # An activity regulariser adds its term in the forward pass, before
        # the towers meet at the gather: each tower's own must be the one
        # its loss reads (the loss adds self.losses).
        activity = keras.regularizers.L2(0.01) if regularised else None
        self.encoder = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(6, activation="tanh",
             activity_regularizer=activity), keras.layers.Dense(4)]
        )  # fmt: skip
        self.log_scale = self.add_weight(shape=(), initializer="zeros", name="scale")
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def call(self, x):
        return self.encoder(x[:, :3]), self.encoder(x[:, 3:])

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            a, b = self(x, training=True)
            if self.gathered:
                a, b = towers.gather(a), towers.gather(b)
            a, b = tf.math.l2_normalize(a, 1), tf.math.l2_normalize(b, 1)
            logits = tf.matmul(a, b, transpose_b=True) * tf.exp(self.log_scale)
            labels = tf.range(tf.shape(logits)[0])
            cross = tf.nn.sparse_softmax_cross_entropy_with_logits
            loss = self.reduce(cross(labels, logits)) + self.reduce(
                cross(labels, tf.transpose(logits))
            )
            for term in self.losses:
                loss += term
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def contrastive(gathered=True, regularised=False, summed=False):
    keras.utils.set_random_seed(5)
    model = ContrastiveStep(gathered, regularised, summed)
    model.compile(optimizer=keras.optimizers.Adam(0.02))
    model(np.zeros((1, 6)))
    return model


@pytest.mark.parametrize("regularised", [False, True], ids=["", "activity"])
@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_contrastive_loss_in_the_step_trains_as_keras_fit_when_gathered(
    num_towers, regularised
):
    x = np.random.default_rng(0).standard_normal((23, 6))  # batches 8, 8, 7
    engine = Towers(contrastive(regularised=regularised), devices=devices(num_towers))
    reference = contrastive(regularised=regularised)
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, **fit)
    expected = reference.fit(x, **fit)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-10
    )


def test_without_gather_a_contrastive_loss_is_refused_by_name():
    # Each tower would see its shard's similarity matrix alone.
    x = np.random.default_rng(0).standard_normal((16, 6))
    model = contrastive(gathered=False)
    engine = Towers(model, devices=devices(2))
    before = model.get_weights()
    with pytest.raises(ValueError, match="neither a mean nor a sum.*towers.gather"):
        engine.fit(x, batch_size=8, shuffle=False, verbose=0)
    for got, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, b)


def test_a_gathered_loss_that_sums_over_the_batch_trains_as_keras_fit():
    # Every tower computes the whole batch's loss, sum or mean alike.
    x = np.random.default_rng(0).standard_normal((23, 6))
    engine = Towers(contrastive(summed=True), devices=devices(3))
    reference = contrastive(summed=True)
    before = reference.get_weights()

    fit = dict(batch_size=8, shuffle=False, verbose=0)
    history = engine.fit(x, **fit)
    expected = reference.fit(x, **fit)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-10
    )

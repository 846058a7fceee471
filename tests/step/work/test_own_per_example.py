"""A model's own train_step whose loss has a value per example, as Keras'
loss functions return one (``keras.losses.mean_squared_error(y, y_pred)``,
the guide's older step): ``tape.gradient`` sums it over the tower's rows, so
the towers' gradients add up as a sum's (towers/step/rules/loss_kinds.py). Against
Keras' own fit on one device, float64, uneven shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import assert_same_updates, regression
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class PerExample(keras.Model):
    """The guide's low-level step with a loss per example; its tracker is fed
    the per-example values. ``reduce``: what makes the loss from the squared
    errors (per example by default)."""

    def __init__(self, *args, reduce=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reduce = reduce
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            if self.reduce is None:
                loss = keras.losses.mean_squared_error(y, y_pred)
            else:
                loss = self.reduce(keras.ops.square(y - y_pred))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def per_example(normalised=False, reduce=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, use_bias=not normalised)(inputs)
    if normalised:
        hidden = keras.layers.BatchNormalization(momentum=0.7)(hidden)
    hidden = keras.layers.Activation("tanh")(hidden)
    model = PerExample(inputs, keras.layers.Dense(2)(hidden), reduce=reduce)
    model.compile(optimizer=keras.optimizers.SGD(0.02))
    return model


@pytest.mark.parametrize("num_towers", [2, 3])
@pytest.mark.parametrize("statistics", ["none", "global"])
def test_a_loss_with_a_value_per_example_trains_as_keras_fit(num_towers, statistics):
    # With a BatchNormalization layer under global statistics, the gradient
    # through the whole batch's moments sums every tower's, unweighted.
    normalised = statistics == "global"
    x, y = regression(23)  # batches of 8, 8, 7: uneven on 2 and 3 towers
    options = {"batch_statistics": "global"} if normalised else {}
    engine = Towers(per_example(normalised), devices=devices(num_towers), **options)
    reference = per_example(normalised)
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, y, **fit)
    expected = reference.fit(x, y, **fit)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-12
    )


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_vector_of_means_is_not_read_as_a_value_per_example(num_towers):
    # A mean per output (2 values): on 3 towers the last batch's shards are
    # 3, 2 and 2 rows, and the probe still finds its length is not the
    # examples'. Each tower's gradient is of a mean, weighted by its share.
    def reduce(squared):
        return keras.ops.mean(squared, axis=0)

    x, y = regression(23)
    engine = Towers(per_example(reduce=reduce), devices=devices(num_towers))
    reference = per_example(reduce=reduce)
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    engine.fit(x, y, **fit)
    reference.fit(x, y, **fit)

    assert_same_updates(engine.model, reference, before)


class MixedKinds(PerExample):
    """Two gradients taken, one of a mean and one of a per-example loss,
    added before one apply: each is handed back as a mean's."""

    def train_step(self, data):
        x, y = data
        variables = self.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            y_pred = self(x, training=True)
            each = keras.losses.mean_squared_error(y, y_pred)
            mean = keras.ops.mean(each)
        grads = [
            a + 0.5 * b
            for a, b in zip(
                tape.gradient(mean, variables), tape.gradient(each, variables)
            )
        ]
        self.optimizer.apply(grads, variables)
        return {"mean": mean}


def test_gradients_of_a_sum_and_of_a_mean_together_train_as_keras_fit():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        model = MixedKinds(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer="sgd")
        return model

    x, y = regression(23)
    engine, reference = Towers(build(), devices=devices(3)), build()
    before = reference.get_weights()

    fit = dict(batch_size=8, shuffle=False, verbose=0)
    engine.fit(x, y, **fit)
    reference.fit(x, y, **fit)

    assert_same_updates(engine.model, reference, before)

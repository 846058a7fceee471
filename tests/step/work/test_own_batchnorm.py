"""BatchNormalization in a model's own train_step on several towers: every
call of a layer in training mode is a meeting, where the first tower moves
its moving statistics at once from every tower's moments (towers/step/
batchnorm.py, ``moving_at_once``). Against Keras' own fit on one device,
float64, uneven shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import GAN, GuideStep, assert_same_updates, gan
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


class NormalisedGAN(GAN):
    """The GAN with a BatchNormalization layer in each network, both called
    in training mode: the generator's runs twice a step (the discriminator's
    step, then its own), the discriminator's three times (real, fake, fake),
    each call on other inputs. The Dense layers before them have no bias (a
    bias there has a zero gradient, which Adam would turn rounding into
    steps of)."""

    def __init__(self, latent=3, sampled=False):
        super().__init__(latent, sampled)
        layers = keras.layers
        self.generator = keras.Sequential(
            [keras.Input((latent,)), layers.Dense(6, use_bias=False),
             layers.BatchNormalization(momentum=0.8), layers.Activation("tanh"),
             layers.Dense(2)]
        )  # fmt: skip
        self.discriminator = keras.Sequential(
            [keras.Input((2,)), layers.Dense(5, use_bias=False),
             layers.BatchNormalization(momentum=0.7), layers.Activation("tanh"),
             layers.Dense(1)]
        )  # fmt: skip


def moving_statistics(model):
    """By position and name (two models' layers are numbered apart)."""
    return {
        (i, v.name): v.numpy()
        for i, v in enumerate(model.weights)
        if v.name in ("moving_mean", "moving_variance")
    }


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_gan_with_batchnorm_trains_as_keras_fit_with_global_statistics(
    num_towers,
):
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((29, 2)), rng.standard_normal((29, 3))
    engine = Towers(
        gan(cls=NormalisedGAN), devices=devices(num_towers), batch_statistics="global"
    )
    reference = gan(cls=NormalisedGAN)
    before = reference.get_weights()
    start = moving_statistics(reference)

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8, 8, 8, 5
    history = engine.fit(real, z, **fit)
    expected = reference.fit(real, z, **fit)

    # Every variable, the four moving statistics included, moved as one
    # device's: each layer's moved at every call, from the whole batch's.
    assert_same_updates(engine.model, reference, before)
    moved = moving_statistics(reference)
    assert len(moved) == 4
    assert all(np.abs(moved[k] - start[k]).max() > 1e-3 for k in moved)
    # Its trackers are fed each shard's mean: the towers' mean, not checked.
    assert sorted(history.history) == sorted(expected.history)


class TwoPasses(GuideStep):
    """A step that runs the model twice on its batch before one apply (a
    consistency term): its BatchNormalization layer moves twice a step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            first = self(x, training=True)
            second = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=(first + second) / 2)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return self.update_metrics(y, first, loss)


def two_passes():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    normalised = keras.layers.BatchNormalization(momentum=0.6)(inputs)
    model = TwoPasses(inputs, keras.layers.Dense(2)(normalised))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_with_tower_statistics_the_moving_statistics_are_the_whole_batchs():
    """Each tower normalises with its own shard's moments, so the weights are
    not one device's; the moving statistics are: a layer on the raw inputs
    moves from the whole batch's moments (``moving_statistics="batch"``),
    twice a step, as on one device."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((19, 5)) * [1, 2, 3, 4, 5] + 2
    y = rng.standard_normal((19, 2))
    engine = Towers(two_passes(), devices=devices(3), batch_statistics="tower")
    reference = two_passes()
    start = moving_statistics(reference)

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8, 8, 3
    engine.fit(x, y, **fit)
    reference.fit(x, y, **fit)

    got, want = moving_statistics(engine.model), moving_statistics(reference)
    assert len(want) == 2
    for key in want:
        assert np.abs(want[key] - start[key]).max() > 0.5
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key[1])
    kernel = engine.model.layers[-1].kernel.numpy()
    assert np.abs(kernel - reference.layers[-1].kernel.numpy()).max() > 1e-4

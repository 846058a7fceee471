"""How a model's own train_step's loss depends on its batch is found, not
declared: each form a user writes trains as Keras' own fit on one device
(float64, 3 uneven towers, plain SGD, no towers option), or is refused by
name with the weights untouched (towers/step/rules/loss_kinds.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tests.step.work.test_own import assert_same_updates, regression
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def penalty(model):
    """A term that does not depend on the batch: an L2 weight penalty."""
    return 0.05 * sum(ops.sum(ops.square(w)) for w in model.trainable_weights)


def squares(model, x, y):
    return ops.square(model(x, training=True) - y)  # f64[n, 2]


# Each form a step's loss takes, from the squared errors of its shard.
FORMS = {
    "per_example": lambda m, x, y, sw: ops.mean(squares(m, x, y), axis=-1),
    "mean": lambda m, x, y, sw: ops.mean(squares(m, x, y)),
    "sum": lambda m, x, y, sw: ops.sum(squares(m, x, y)),
    "compute_loss": lambda m, x, y, sw: m.compute_loss(
        x=x, y=y, y_pred=m(x, training=True)
    ),
    "mean_plus_penalty": lambda m, x, y, sw: ops.mean(squares(m, x, y)) + penalty(m),
    "sum_plus_penalty": lambda m, x, y, sw: ops.sum(squares(m, x, y)) + penalty(m),
    "penalty_plus_half_sum": lambda m, x, y, sw: (
        penalty(m) - 0.5 * -ops.sum(squares(m, x, y))
    ),
    "sum_over_batch_size": lambda m, x, y, sw: (
        ops.sum(squares(m, x, y)) / ops.cast(tf.shape(x)[0], "float64")
    ),
    "weighted_per_example": lambda m, x, y, sw: (
        ops.mean(squares(m, x, y), axis=-1) * sw
    ),
    # Keras' compute_loss adds model.losses: a weight regulariser (it reads
    # its variable) and an add_loss term, read in the probe's stateless
    # scope as in the step (it had crashed on the regulariser).
    "model_losses": lambda m, x, y, sw: m.compute_loss(
        x=x, y=y, y_pred=m(x, training=True)
    ),
}


class MeanTerm(keras.layers.Layer):
    """Adds a mean over its inputs' examples (``add_loss``)."""

    def call(self, x):
        self.add_loss(0.1 * ops.mean(ops.square(x)))
        return x


class OwnLoss(keras.Model):
    """A step whose loss is ``form(model, x, y, sample_weight)``; it returns
    the loss (a vector's mean), as a user's step does."""

    def __init__(self, *args, form=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.form = form

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.form(self, x, y, sample_weight)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"value": loss if len(loss.shape) == 0 else ops.mean(loss)}

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss = self.form(self, x, y, sample_weight)
        return {"value": loss if len(loss.shape) == 0 else ops.mean(loss)}


def own_loss(form, normalised=False):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    penalised = form is FORMS["model_losses"]
    l2 = keras.regularizers.L2(0.01) if penalised else None
    hidden = keras.layers.Dense(7, activation="tanh", kernel_regularizer=l2)(inputs)
    if penalised:
        hidden = MeanTerm()(hidden)
    if normalised:
        hidden = keras.layers.BatchNormalization(momentum=0.7)(hidden)
    model = OwnLoss(inputs, keras.layers.Dense(2)(hidden), form=form)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_of_an_own_steps_loss_trains_as_keras_fit(name):
    x, y = regression(23)  # batches of 8, 8, 7: 3+3+2 and 3+2+2 on 3 towers
    weights = np.random.default_rng(1).uniform(0.5, 2.0, 23)
    given = {"sample_weight": weights} if name.startswith("weighted") else {}
    engine = Towers(own_loss(FORMS[name]), devices=devices(3))
    reference = own_loss(FORMS[name])
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, shuffle=False, verbose=0, **given)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0, **given)

    assert_same_updates(engine.model, reference, before)
    moved = [np.abs(w - b).max() for w, b in zip(reference.get_weights(), before)]
    assert min(moved) > 1e-4  # every variable trained
    np.testing.assert_allclose(
        history.history["value"], expected.history["value"], rtol=1e-12
    )
    # Its test_step returns the loss too: the last batch's, as Keras' is.
    got = engine.evaluate(x, y, batch_size=8, verbose=0, return_dict=True, **given)
    want = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True, **given)
    np.testing.assert_allclose(got["value"], want["value"], rtol=1e-12)


@pytest.mark.parametrize("name", ["sum_plus_penalty", "mean"])
def test_a_form_through_batch_normalization_trains_as_keras_fit(name):
    # The probe normalises each example alone with the two's moments, as
    # the towers do under global statistics.
    x, y = regression(23)
    engine = Towers(
        own_loss(FORMS[name], normalised=True),
        devices=devices(3),
        batch_statistics="global",
    )
    reference = own_loss(FORMS[name], normalised=True)
    before = reference.get_weights()

    engine.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)


class TwoLosses(keras.Model):
    """Two tape.gradient calls in one step, of a sum and of a mean, whose
    gradients the step adds before its one apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            summed = ops.sum(squares(self, x, y)) + penalty(self)
            mean = ops.mean(ops.abs(self(x, training=True) - y))
        variables = self.trainable_variables
        grads = [
            a + b
            for a, b in zip(
                tape.gradient(summed, variables), tape.gradient(mean, variables)
            )
        ]
        self.optimizer.apply(grads, variables)
        # Not the tensors taken the gradient of: read as the probe found them.
        return {"summed": summed * 1.0, "mean": mean * 1.0}


def test_a_steps_gradients_of_a_sum_and_of_a_mean_added_train_as_keras_fit():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        model = TwoLosses(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.01))
        return model

    x, y = regression(23)
    engine, reference = Towers(build(), devices=devices(3)), build()
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    for key in ("summed", "mean"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-12
        )


def test_a_loss_that_couples_the_examples_is_refused_with_nothing_updated():
    # The batch's largest error: neither a mean nor a sum over the examples.
    model = own_loss(lambda m, x, y, sw: ops.max(squares(m, x, y)))
    engine = Towers(model, devices=devices(3))
    before = model.get_weights()
    x, y = regression(8)

    with pytest.raises(ValueError, match="neither a mean nor a sum") as raised:
        engine.fit(x, y, batch_size=8, verbose=0)

    assert "OwnLoss.train_step" in str(raised.value)
    assert "towers.gather" in str(raised.value)
    for got, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, b)
    assert int(model.optimizer.iterations) == 0


def test_a_loss_on_one_tower_alone_is_one_devices_whatever_its_kind(monkeypatch):
    # The whole batch on one tower: its gradients are one device's, so the
    # probe (three more traces of the step) is not run, and a loss that
    # couples the examples trains as on one device.
    from towers.step.rules import probe

    def probed(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "probe", probed)
    form = lambda m, x, y, sw: ops.max(squares(m, x, y))  # noqa: E731
    engine = Towers(own_loss(form), devices=devices(1))
    reference = own_loss(form)
    before = reference.get_weights()
    x, y = regression(23)

    history = engine.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["value"], expected.history["value"], rtol=1e-12
    )


class InputPenalty(keras.Model):
    """WGAN-GP's gradient penalty, in small: an inner tape.gradient of the
    outputs with respect to the inputs (a value per example, not a weight's
    gradient), its norms in a mean the outer tape differentiates."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                y_pred = self(x, training=True)
            slopes = inner.gradient(y_pred, x)  # f64[n, 5]
            norms = ops.sqrt(ops.sum(ops.square(slopes), axis=1))
            loss = ops.mean(ops.square(y_pred - y)) + ops.mean((norms - 1.0) ** 2)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"value": loss}


def test_a_gradient_with_respect_to_the_inputs_is_the_examples_own():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(7, activation="tanh")(inputs)
        model = InputPenalty(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    x, y = regression(23)
    y = y[:, :1]
    engine, reference = Towers(build(), devices=devices(3)), build()
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["value"], expected.history["value"], rtol=1e-12
    )


class SummedGAN(keras.Model):
    """A GAN whose discriminator loss sums over real and generated rows, the
    latents a draw per row (a static shape on each tower: no tensor of the
    batch reaches them, yet they move with its rows), with an EMA of the
    generator and a Mean tracker, as keras.io's GANs have."""

    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(7)
        self.g = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, "tanh")])
        self.d = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        self.tracker = keras.metrics.Mean(name="g_loss")
        self.ema = [keras.Variable(ops.zeros_like(w), trainable=False)
                    for w in self.g.weights]  # fmt: skip

    @property
    def metrics(self):
        return [self.tracker]

    def call(self, x):
        return self.d(x)

    def train_step(self, x):
        g_opt = self.g_optimizer
        z = keras.random.normal((ops.shape(x)[0], 3), seed=self.seed)
        with tf.GradientTape() as tape:
            fake = self.g(z)
            d_loss = ops.sum(ops.softplus(-self.d(x))) + ops.sum(
                ops.softplus(self.d(fake))
            )
        self.optimizer.apply(tape.gradient(d_loss, self.d.weights), self.d.weights)
        z = keras.random.normal((ops.shape(x)[0], 3), seed=self.seed)
        with tf.GradientTape() as tape:
            g_loss = ops.mean(ops.softplus(-self.d(self.g(z)))) + penalty(self.g)
        g_opt.apply(tape.gradient(g_loss, self.g.weights), self.g.weights)
        for average, w in zip(self.ema, self.g.weights):
            average.assign(0.9 * average + 0.1 * w)
        self.tracker.update_state(g_loss)
        return {"d_loss": d_loss, "g_loss": self.tracker.result()}


def test_a_gan_whose_loss_sums_over_drawn_rows_trains_as_keras_fit():
    def build():
        keras.utils.set_random_seed(1)
        model = SummedGAN()
        model(np.zeros((1, 5)))
        model.compile(optimizer=keras.optimizers.SGD(0.02))
        model.g_optimizer = keras.optimizers.SGD(0.05)
        return model

    x = regression(23)[0]
    engine, reference = Towers(build(), devices=devices(3)), build()
    before = [v.numpy() for v in reference.variables]

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, **fit)
    expected = reference.fit(x, **fit)

    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=1e-12, atol=1e-14, err_msg=want.path
        )
    assert int(engine.model.g_optimizer.iterations) == 6
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-12
        )


@pytest.mark.parametrize("draws", [None, "the data's rows", "blocks of them"])
def test_the_probe_traces_the_step_once_where_it_draws_nothing(draws):
    # Two examples together, then each alone: one trace for parts of any
    # rows serves the three where the step draws nothing; a draw's place in
    # one device's draw needs the parts' rows (a draw over two blocks of the
    # data's rows reads as the part's where they are unknown), so each shape
    # is then traced, the two of one example sharing theirs (the second
    # example's draws placed by a tensor, not a constant).
    from towers.step.rules import probe

    traced = []

    class Counted(OwnLoss):
        def train_step(self, data):
            x, y = data
            traced.append(x.shape[0])
            if draws is not None:  # noise over the rows, or two blocks of them
                rows = keras.ops.shape(x)[0]
                blocks = 2 if draws == "blocks of them" else 1
                noise = keras.random.normal((blocks * rows, 5), seed=1)
                x = x + 0.1 * noise[:rows] + 0.1 * noise[(blocks - 1) * rows :]
            return super().train_step((x, y))

    inputs = keras.Input((5,))
    model = Counted(inputs, keras.layers.Dense(2)(inputs), form=FORMS["sum"])
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression(8)

    found = probe.probe(model, (x, y, None), "train_step")

    assert found.losses == ["sum"]
    assert traced == ([None] if draws is None else [None, 2, 1])


def test_a_loss_zero_on_the_first_two_examples_is_read_on_the_next_two():
    # Both readings fit a loss of 0: the probe tries the next pair, through
    # the traces it made for the first.
    from towers.step.rules import probe

    form = lambda m, x, y, sw: ops.sum(squares(m, x, y) * x[:, :1])  # noqa: E731
    x, y = regression(8)
    x[:2, 0] = 0.0  # examples 0 and 1 add nothing

    found = probe.probe(own_loss(form), (x, y, None), "train_step")

    assert found.losses == ["sum"]

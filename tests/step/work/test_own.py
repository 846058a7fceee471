"""A model's own train_step, test_step and predict_step on towers, against
Keras' own fit, evaluate and predict on one device (float64, uneven shards,
2 and 3 towers): every tower runs the model's step on its shard and the
towers meet at each apply (towers/step/work/own.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from towers import Towers

FLOAT64_RTOL, FLOAT64_ATOL = 1e-12, 1e-14


pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def assert_same_updates(model, reference, before):
    for got, want, b, var in zip(
        model.get_weights(), reference.get_weights(), before, reference.weights
    ):
        np.testing.assert_allclose(
            got - b, want - b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, err_msg=var.path
        )


class GuideStep(keras.Model):
    """Keras' guide "Customizing what happens in fit()": compute_loss, a
    GradientTape, optimizer.apply, the metrics through self.metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        variables = self.trainable_variables
        self.apply_update(tape.gradient(loss, variables), variables)
        return self.update_metrics(y, y_pred, loss)

    def apply_update(self, grads, variables):
        self.optimizer.apply(grads, variables)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self.update_metrics(y, y_pred, self.compute_loss(y=y, y_pred=y_pred))

    def update_metrics(self, y, y_pred, loss):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def guide_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh")(inputs)
    model = GuideStep(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def regression(examples=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((examples, 5)), rng.standard_normal((examples, 2))


@pytest.mark.parametrize("num_towers", [2, 3])
def test_the_guides_train_step_trains_as_keras_fit(num_towers):
    x, y = regression(23)  # batches of 8, 8, 7: uneven on 2 and 3 towers
    engine = Towers(guide_model(), devices=devices(num_towers))
    reference = guide_model()
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    assert int(engine.model.optimizer.iterations) == 6
    # A streaming metric sees every tower's examples: the whole batch's.
    np.testing.assert_allclose(
        history.history["mae"], expected.history["mae"], rtol=1e-12
    )
    got = engine.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose(got["mae"], want["mae"], rtol=1e-12)
    # The step returns {"loss", "compile_metrics": {...}}: not the metrics'
    # names, so Keras keeps the step's logs, flattened in name order (what its
    # progress bar prints and History and evaluate list).
    assert list(history.history) == list(expected.history) == ["mae", "loss"]
    assert list(got) == list(want)


class SumStep(keras.Model):
    """A step whose loss sums over its batch, returned as it is."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.sum(keras.ops.square(self(x, training=True) - y))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"total": loss}


def sum_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh")(inputs)
    model = SumStep(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    return model


def test_a_step_whose_loss_is_a_sum_trains_as_keras_fit():
    # Found by the probe (towers/step/rules/loss_kinds.py); its value returned
    # as it is is the batch's sum.
    x, y = regression(23)
    engine = Towers(sum_model(), devices=devices(3))
    reference = sum_model()
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["total"], expected.history["total"], rtol=1e-12
    )


def test_a_tracker_fed_each_shards_mean_is_one_devices_on_equal_shards():
    x, y = regression(24)  # batches of 8: 4 + 4 on 2 towers
    engine = Towers(guide_model(), devices=devices(2))
    reference = guide_model()

    history = engine.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-12
    )


class WeightedStep(keras.Model):
    """The guide's step with sample weights."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics if m.name != "loss"}


class LowLevelStep(keras.Model):
    """The guide's low-level step: its own loss function and trackers, a
    metrics property, no compiled loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}


def variant(cls, **compile_args):
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(7, activation="tanh")(inputs)
        model = cls(inputs, keras.layers.Dense(2)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1), **compile_args)
        return model

    return build


@pytest.mark.parametrize(
    "build, weighted",
    [
        (variant(WeightedStep, loss="mse", weighted_metrics=["mae"]), True),
        (variant(LowLevelStep), False),
    ],
    ids=["sample-weights", "low-level"],
)
def test_the_guides_other_steps_train_as_keras_fit(build, weighted):
    x, y = regression(21)
    sample_weight = np.linspace(0.5, 2.0, 21) if weighted else None
    engine = Towers(build(), devices=devices(3))
    reference = build()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, y, sample_weight=sample_weight, **fit)
    expected = reference.fit(x, y, sample_weight=sample_weight, **fit)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["mae"], expected.history["mae"], rtol=1e-12
    )


class RawLoss(keras.Model):
    """A step that returns its loss as it is, with no tracker."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((y - self(x, training=True)) ** 2)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"raw": loss}


def test_a_value_the_step_returns_as_it_is_is_the_batchs_in_the_logs():
    x, y = regression(21)
    engine = Towers(variant(RawLoss)(), devices=devices(3))
    reference = variant(RawLoss)()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, y, **fit)
    expected = reference.fit(x, y, **fit)

    # The last batch's loss (5 examples: 2 + 2 + 1), the towers' weighted.
    np.testing.assert_allclose(
        history.history["raw"], expected.history["raw"], rtol=1e-12
    )


class VAE(keras.Model):
    """keras.io's VAE step: the reparameterisation with a drawn epsilon (times
    ``noise``), a reconstruction loss and the KL term, both means over the
    batch."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise
        self.encoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        self.decoder = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(5, activation="tanh"),
             keras.layers.Dense(4)]
        )  # fmt: skip
        self.total = keras.metrics.Mean(name="total_loss")
        self.seed_generator = keras.random.SeedGenerator(5)

    @property
    def metrics(self):
        return [self.total]

    def call(self, x):
        return self.decoder(self.encoder(x)[:, :2])

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            z_mean, z_log_var = keras.ops.split(self.encoder(x), 2, axis=1)
            epsilon = keras.random.normal(
                keras.ops.shape(z_mean), seed=self.seed_generator, dtype=x.dtype
            )
            z = z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon * self.noise
            error = keras.ops.sum((x - self.decoder(z)) ** 2, axis=1)
            kl = -0.5 * keras.ops.sum(
                1 + z_log_var - z_mean**2 - keras.ops.exp(z_log_var), axis=1
            )
            loss = keras.ops.mean(error + kl)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.total.update_state(loss)
        return {"total_loss": self.total.result()}


def vae(noise):
    keras.utils.set_random_seed(2)
    model = VAE(noise)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    model(np.zeros((1, 4)))
    return model


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_vae_drawing_its_epsilon_trains_as_keras_fit(num_towers):
    # Each tower draws its rows of the batch's epsilon (towers/step/rules/draws.py).
    x = np.random.default_rng(0).standard_normal((19, 4))
    engine = Towers(vae(1.0), devices=devices(num_towers))
    reference = vae(1.0)
    before = reference.get_weights()

    history = engine.fit(x, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["total_loss"], expected.history["total_loss"], rtol=1e-12
    )


class GAN(keras.Model):
    """Two networks, two optimizers; the generator's loss goes through the
    discriminator after the discriminator's update (keras.io's DCGAN step,
    with the latent vectors in the data so the draws are one device's)."""

    def __init__(self, latent=3, sampled=False):
        super().__init__()
        self.latent, self.sampled = latent, sampled
        self.generator = keras.Sequential(
            [keras.Input((latent,)), keras.layers.Dense(6, activation="tanh"),
             keras.layers.Dense(2)]
        )  # fmt: skip
        self.discriminator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(5, activation="tanh"),
             keras.layers.Dense(1)]
        )  # fmt: skip
        self.d_loss = keras.metrics.Mean(name="d_loss")
        self.g_loss = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(7)

    @property
    def metrics(self):
        return [self.d_loss, self.g_loss]

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def call(self, z):
        return self.generator(z)

    def rows_of(self, real):
        return keras.ops.shape(real)[0]

    def train_step(self, data):
        real, z, _ = keras.utils.unpack_x_y_sample_weight(data)
        if self.sampled:
            shape = (self.rows_of(real), self.latent)
            z = keras.random.normal(shape, seed=self.seed_generator, dtype=real.dtype)
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        d = self.discriminator
        with tf.GradientTape() as tape:
            real_logits = d(real, training=True)
            fake_logits = d(self.generator(z, training=True), training=True)
            d_loss = bce(keras.ops.ones_like(real_logits), real_logits) + bce(
                keras.ops.zeros_like(fake_logits), fake_logits
            )
        grads = tape.gradient(d_loss, d.trainable_variables)
        self.d_optimizer.apply(grads, d.trainable_variables)
        with tf.GradientTape() as tape:
            fake_logits = d(self.generator(z, training=True), training=True)
            g_loss = bce(keras.ops.ones_like(fake_logits), fake_logits)
        variables = self.generator.trainable_variables
        grads = tape.gradient(g_loss, variables)
        self.g_optimizer.apply_gradients(zip(grads, variables))
        self.d_loss.update_state(d_loss)
        self.g_loss.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def gan(sampled=False, cls=GAN):
    keras.utils.set_random_seed(1)
    model = cls(sampled=sampled)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.1, momentum=0.5))
    model(np.zeros((1, 3)))
    return model


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_gan_with_two_optimizers_trains_as_keras_fit(num_towers):
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((29, 2)), rng.standard_normal((29, 3))
    engine = Towers(gan(), devices=devices(num_towers))
    reference = gan()
    before = reference.get_weights()

    # Three steps of 8 and an uneven one of 5, twice.
    history = engine.fit(real, z, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference.fit(real, z, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    assert int(engine.model.d_optimizer.iterations) == 8
    assert int(engine.model.g_optimizer.iterations) == 8
    assert sorted(history.history) == ["d_loss", "g_loss"]
    assert engine.steps_done == 8


def test_a_gan_resumed_from_its_checkpoint_trains_as_one_never_stopped(tmp_path):
    """The optimizers a GAN holds as its own attributes (not the engine's)
    are saved with it, slots and iterations, and restored."""
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((29, 2)), rng.standard_normal((29, 3))
    run = dict(batch_size=8, shuffle=False, verbose=0)
    stopped = Towers(gan(), devices=devices(2))
    stopped.fit(real, z, epochs=1, checkpoint_dir=str(tmp_path), **run)
    resumed = Towers(gan(), devices=devices(2))
    resumed.fit(real, z, epochs=2, checkpoint_dir=str(tmp_path), **run)
    straight = Towers(gan(), devices=devices(2))
    straight.fit(real, z, epochs=2, **run)

    for name in ("d_optimizer", "g_optimizer"):
        mine, theirs = (getattr(e.model, name) for e in (resumed, straight))
        assert int(mine.iterations) == int(theirs.iterations) == 8
        for v, w in zip(mine.variables, theirs.variables, strict=True):
            np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)
    for v, w in zip(resumed.model.weights, straight.model.weights, strict=True):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_gan_drawing_its_latents_trains_as_keras_fit(num_towers):
    # Each tower draws its rows of the batch's latent vectors (towers/step/
    # draws.py); the generator's state moves once a step.
    rng = np.random.default_rng(0)
    real = rng.standard_normal((29, 2))
    engine = Towers(gan(sampled=True), devices=devices(num_towers))
    reference = gan(sampled=True)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(real, batch_size=8, epochs=2, verbose=0, shuffle=False)
    expected = reference.fit(real, batch_size=8, epochs=2, verbose=0, shuffle=False)

    for got, want, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            got.numpy() - b, want.numpy() - b, rtol=FLOAT64_RTOL,
            atol=FLOAT64_ATOL, err_msg=want.path,
        )  # fmt: skip
    state = engine.model.seed_generator.state.numpy()
    np.testing.assert_array_equal(state, reference.seed_generator.state.numpy())
    assert state[1] == 8  # one draw a step
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=FLOAT64_RTOL
        )


class DictPredictions(GuideStep):
    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        y_pred = self(x, training=False)
        return {"mean": keras.ops.mean(y_pred, axis=1), "outputs": y_pred}


def test_test_step_and_a_predict_step_returning_a_dict_are_the_models_own():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    model = DictPredictions(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y = regression(11)
    engine = Towers(model, devices=devices(3))

    got = engine.predict(x, batch_size=11, verbose=0)
    want = model.predict(x, batch_size=11, verbose=0)

    assert sorted(got) == ["mean", "outputs"]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12)
    # test_step: the metric it updates sees every tower's examples.
    got = engine.evaluate(x, y, batch_size=11, verbose=0, return_dict=True)
    want = model.evaluate(x, y, batch_size=11, verbose=0, return_dict=True)
    np.testing.assert_allclose(got["mae"], want["mae"], rtol=1e-12)


class OwnMetrics(keras.Model):
    """Keras' own train_step, with a compute_metrics override that updates a
    metric of the model's besides the compiled ones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.largest = keras.metrics.Sum(name="abs_sum")

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.largest.update_state(keras.ops.sum(keras.ops.abs(y_pred)))
        return super().compute_metrics(x, y, y_pred, sample_weight)


def own_metrics():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    model = OwnMetrics(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def test_a_compute_metrics_override_runs_in_keras_own_step_on_every_tower():
    x, y = regression(19)
    engine = Towers(own_metrics(), devices=devices(3))
    reference = own_metrics()
    before = reference.get_weights()

    history = engine.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)
    # Keras' own step weighs the loss tracker by each shard's examples.
    for key in ("loss", "mae", "abs_sum"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-12, err_msg=key
        )


class ShardDependentApplies(GuideStep):
    """Applies twice on a shard of more than 3 examples, once otherwise."""

    def train_step(self, data):
        x, y = data
        variables = self.trainable_variables
        grads = []
        for _ in range(2):  # the same gradients on every shard
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads.append(tape.gradient(loss, variables))
        for taken in grads[: 2 if x.shape[0] > 3 else 1]:
            self.optimizer.apply(taken, variables)
        return {}


def test_towers_reaching_different_applies_fail_before_any_update():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    model = ShardDependentApplies(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    engine = Towers(model, devices=devices(2))
    before = model.get_weights()
    x, y = regression(7)  # 4 + 3

    with pytest.raises(ValueError, match="train_step.*applies"):
        engine.fit(x, y, batch_size=7, verbose=0)

    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert int(model.optimizer.iterations) == 0


def test_what_a_models_own_step_cannot_run_with_is_refused_by_name():
    with pytest.raises(ValueError, match="jit_compile=True"):
        Towers(guide_model(), devices=devices(2), jit_compile=True)


def test_towers_explain_shows_where_a_models_own_step_meets():
    engine = Towers(gan(), devices=devices(2))
    before = engine.model.get_weights()
    rng = np.random.default_rng(0)

    report = engine.explain(rng.standard_normal((5, 2)), rng.standard_normal((5, 3)))

    model = engine.model
    assert [line.split(":")[0] for line in report.meetings] == [
        f"{model.d_optimizer.name}.apply",
        f"{model.g_optimizer.name}.apply",
    ]
    assert "the towers meet at" in str(report)
    assert report.ran_on("apply") == ["/device:CPU:0"]
    assert report.ran_on("tower 1 forward")[0] == "/device:CPU:1"
    for got, want in zip(engine.model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


class OwnPredictStep(keras.Model):
    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return {"doubled": 2 * self(x, training=False)}


def own_predict_step():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    model = OwnPredictStep(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_predict_step_alone_leaves_training_to_towers_own_exact_step():
    x, y = regression(19)
    engine = Towers(own_predict_step(), devices=devices(2), batch_statistics="global")
    reference = own_predict_step()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    engine.fit(x, y, **fit)
    reference.fit(x, y, **fit)

    # The whole batch's statistics, the moving ones moved once a step.
    assert_same_updates(engine.model, reference, before)
    got = engine.predict(x, batch_size=8, verbose=0)
    want = reference.predict(x, batch_size=8, verbose=0)
    np.testing.assert_allclose(got["doubled"], want["doubled"], rtol=1e-12)


class KeywordApply(GuideStep):
    """The guide's step, its apply given the variables by Keras' keyword."""

    def apply_update(self, grads, variables):
        self.optimizer.apply(grads, trainable_variables=variables)


def test_an_apply_given_its_variables_by_keyword_trains_as_keras_fit():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        model = KeywordApply(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    x, y = regression(23)
    engine, reference = Towers(build(), devices=devices(2)), build()
    before = reference.get_weights()
    engine.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert_same_updates(engine.model, reference, before)

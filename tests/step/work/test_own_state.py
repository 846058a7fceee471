"""What a model's own train_step changes besides its applies, on towers,
against Keras' own fit on one device (float64, uneven shards): a variable the
step assigns moves once, to one device's value, or the step is refused by name
before any update; a tracker fed the step's batch means reports the batch's
(towers/step/rules/assignments.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.step.work.test_own import FLOAT64_RTOL, VAE, regression
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)


def assert_every_variable_moved_alike(model, reference, before):
    """Every variable's update (after - before), the untrained ones and the
    seed generators' states too."""
    for got, want, b, var in zip(
        [v.numpy() for v in model.variables],
        [v.numpy() for v in reference.variables],
        before,
        reference.variables,
    ):
        np.testing.assert_allclose(
            got - b, want - b, rtol=FLOAT64_RTOL, atol=1e-13, err_msg=var.path
        )


def network(width=6):
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(width, activation="tanh"),
         keras.layers.Dense(2)]
    )  # fmt: skip


def normalised_network():
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(6, use_bias=False),
         keras.layers.BatchNormalization(),
         keras.layers.Activation("tanh"), keras.layers.Dense(2)]
    )  # fmt: skip


class Follower(keras.Model):
    """A network that trains and a second one that follows it after the
    apply, ``follower = rate * follower + (1 - rate) * network``; the tracker
    is fed the step's batch mean."""

    rate = 0.9
    make = staticmethod(network)

    def __init__(self):
        super().__init__()
        self.network = self.make()
        self.follower = self.make()
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def loss_of(self, x, y):
        return keras.ops.mean((self.network(x, training=True) - y) ** 2)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_of(x, y)
        weights = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, weights), weights)
        for w, fw in zip(self.network.weights, self.follower.weights):
            fw.assign(self.rate * fw + (1.0 - self.rate) * w)
        self.tracker.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


class EMAStep(Follower):
    """keras.io's DDIM shape: the EMA copy starts as the network, and is
    what the model predicts with."""

    def __init__(self):
        super().__init__()
        self.follower.set_weights(self.network.get_weights())

    def call(self, x):
        return self.follower(x)


class NormalisedEMAStep(EMAStep):
    """keras.io's DDIM in full: the network normalises its batches, and the
    step's EMA follows its moving statistics too, which the copy's layers,
    never called in training, do not move themselves."""

    make = staticmethod(normalised_network)


class BYOLStep(Follower):
    """BYOL's shape: the online network's loss reads the target network."""

    rate = 0.7

    def call(self, x):
        return self.network(x)

    def loss_of(self, x, y):
        guess = self.network(x, training=True)
        return keras.ops.mean((guess - self.follower(x) - y) ** 2)


def built(cls, seed=3):
    keras.utils.set_random_seed(seed)
    model = cls()
    model.compile(optimizer=keras.optimizers.Adam(0.02))
    model(np.zeros((1, 5)))
    return model


@pytest.mark.parametrize(
    "cls", [EMAStep, NormalisedEMAStep, BYOLStep], ids=["ema", "ema_bn", "byol"]
)
@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_network_the_step_assigns_moves_once_as_on_one_device(cls, num_towers):
    x, y = regression(23)  # batches 8, 8, 7: uneven on 2 and 3 towers
    engine = Towers(built(cls), devices=devices(num_towers))
    reference = built(cls)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    assert_every_variable_moved_alike(engine.model, reference, before)
    assert int(engine.model.optimizer.iterations) == int(reference.optimizer.iterations)
    # The tracker fed each step's batch mean: the batch's, on uneven shards.
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=FLOAT64_RTOL
    )


def test_the_optimizer_gets_slots_for_what_the_step_applies_to_only():
    x, y = regression(16)
    engine = Towers(built(EMAStep), devices=devices(2))
    reference = built(EMAStep)
    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)
    # Keras' optimizer is built by the step's first apply, over the network's
    # weights: the EMA copy gets no moments.
    got = sorted(tuple(v.shape) for v in engine.model.optimizer.variables)
    want = sorted(tuple(v.shape) for v in reference.optimizer.variables)
    assert got == want


class AugmentStep(keras.Model):
    """GAN-ADA's shape: a probability assigned from a statistic of the
    batch (the share of positive predictions), which the step reads."""

    def __init__(self, gathered=False):
        super().__init__()
        self.gathered = gathered
        self.network = network()
        self.p = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="p"
        )

    def call(self, x):
        return self.network(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.network(x, training=True) * (1.0 + self.p)
            loss = keras.ops.mean((y_pred - y) ** 2)
        weights = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, weights), weights)
        signs = y_pred[:, 0]
        if self.gathered:
            signs = towers.gather(signs)
        accuracy = keras.ops.mean(keras.ops.cast(signs > 0, "float64"))
        self.p.assign(keras.ops.clip(self.p + 0.3 * (accuracy - 0.4), 0.0, 1.0))
        return {"p": self.p}


class QueueStep(keras.Model):
    """MoCo's shape: a queue of keys, rolled with the batch's keys in
    example order; the loss reads the queue."""

    def __init__(self, gathered=False, size=10):
        super().__init__()
        self.gathered = gathered
        self.network = network(4)
        self.queue = self.add_weight(
            shape=(size, 2), initializer="ones", trainable=False, name="queue"
        )

    def call(self, x):
        return self.network(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            keys = self.network(x, training=True)
            read = keras.ops.mean(keys @ keras.ops.transpose(self.queue))
            loss = keras.ops.mean((keys - y) ** 2) + 0.1 * read
        weights = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, weights), weights)
        keys = tf.stop_gradient(keys)
        if self.gathered:
            keys = towers.gather(keys)
        rows = keras.ops.shape(keys)[0]
        self.queue.assign(keras.ops.concatenate([keys, self.queue[: 10 - rows]], 0))
        return {"loss": loss}


@pytest.mark.parametrize("cls", [AugmentStep, QueueStep], ids=["p", "queue"])
def test_a_value_of_each_shard_assigned_in_the_step_is_refused_by_name(cls):
    x, y = regression(16)
    engine = Towers(built(cls), devices=devices(2))
    before = [v.numpy() for v in engine.model.variables]
    assigned = "p" if cls is AugmentStep else "queue"
    named = f"variable '.*{assigned}' is assigned.*towers.gather"
    with pytest.raises(ValueError, match=named):
        engine.fit(x, y, **FIT)
    for b, v in zip(before, engine.model.variables):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert int(engine.model.optimizer.iterations) == 0


@pytest.mark.parametrize("cls", [AugmentStep, QueueStep], ids=["p", "queue"])
@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_value_of_the_gathered_batch_assigned_in_the_step_is_one_devices(
    cls, num_towers
):
    x, y = regression(23)
    engine = Towers(built(lambda: cls(gathered=True)), devices=devices(num_towers))
    reference = built(lambda: cls(gathered=True))
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    assert_every_variable_moved_alike(engine.model, reference, before)
    key = "p" if cls is AugmentStep else "loss"
    np.testing.assert_allclose(
        history.history[key], expected.history[key], rtol=FLOAT64_RTOL
    )


class CountStep(keras.Model):
    """A step that counts its examples in a variable made to add up."""

    def __init__(self):
        super().__init__()
        self.network = network()
        self.seen = self.add_weight(
            shape=(), initializer="zeros", trainable=False, aggregation="sum"
        )

    def call(self, x):
        return self.network(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self.network(x, training=True) - y) ** 2)
        weights = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, weights), weights)
        self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "float64"))
        return {"seen": self.seen}


def test_a_variable_made_to_sum_adds_the_towers_changes():
    x, y = regression(23)
    engine = Towers(built(CountStep), devices=devices(3))
    reference = built(CountStep)
    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)
    assert float(engine.model.seen) == float(reference.seen) == 46.0


class CastStep(CountStep):
    """A float32 variable of a float64 model, assigned a float64 value: Keras
    casts it."""

    def __init__(self):
        super().__init__()
        self.level = self.add_weight(
            shape=(), dtype="float32", initializer="zeros", trainable=False,
            aggregation="mean",
        )  # fmt: skip

    def train_step(self, data):
        logs = super().train_step(data)
        self.level.assign(keras.ops.mean(data[0]))  # float64
        return logs


def test_a_float64_value_assigned_to_a_float32_variable_is_cast_as_keras_does():
    x, y = regression(23)
    engine = Towers(built(CastStep), devices=devices(3))
    reference = built(CastStep)
    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)
    assert engine.model.level.dtype == "float32"
    np.testing.assert_allclose(
        float(engine.model.level), float(reference.level), rtol=1e-6
    )


class ExtraLogStep(keras.Model):
    """An own test_step that adds one entry to Keras' logs."""

    def test_step(self, data):
        logs = super().test_step(data)
        x, y = data
        logs["spread"] = keras.ops.std(self(x) - y)
        return logs


def test_evaluate_returns_what_an_own_test_step_adds_to_the_logs():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        model = ExtraLogStep(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    x, y = regression(16)
    engine = Towers(build(), devices=devices(2))
    reference = build()
    got = engine.evaluate(x, y, batch_size=16, verbose=0)
    want = reference.evaluate(x, y, batch_size=16, verbose=0)
    assert len(got) == len(want) == 3
    got = engine.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose(got["mae"], want["mae"], rtol=FLOAT64_RTOL)


class CallLessGAN(keras.Model):
    """keras.io's DCGAN shape: two networks, two optimizers, and no call()
    (Keras' fit never calls the model; the latents come with the data)."""

    def __init__(self):
        super().__init__()
        self.discriminator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(4, activation="tanh"),
             keras.layers.Dense(1)]
        )  # fmt: skip
        self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self):
        super().compile()
        self.d_optimizer = keras.optimizers.Adam(0.05)
        self.g_optimizer = keras.optimizers.SGD(0.1)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def train_step(self, data):
        real, z = data
        rows = keras.ops.shape(real)[0]
        ones, zeros = keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))
        with tf.GradientTape() as tape:
            fake = self.generator(z)
            d_loss = self.loss_fn(ones, self.discriminator(real)) + self.loss_fn(
                zeros, self.discriminator(fake)
            )
        d = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, d), d))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(ones, self.discriminator(self.generator(z)))
        g = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, g), g))
        self.d_tracker.update_state(d_loss)
        self.g_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


class CallLessVAE(VAE):
    """keras.io's VAE shape: the suite's VAE (its noise scaled to 0, so the
    draws do not matter) without a call()."""

    call = keras.Model.call

    def __init__(self):
        super().__init__(noise=0.0)


def call_less(cls):
    keras.utils.set_random_seed(4)
    model = cls()
    if cls is CallLessGAN:
        model.compile()
    else:
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


@pytest.mark.parametrize("cls", [CallLessGAN, CallLessVAE], ids=["dcgan", "vae"])
def test_a_model_with_no_call_trains_as_keras_fit_without_being_called(cls):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((19, 4))
    data = (x[:, :2], rng.standard_normal((19, 3))) if cls is CallLessGAN else (x,)
    engine = Towers(call_less(cls), devices=devices(2))
    reference = call_less(cls)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(*data, **FIT)
    expected = reference.fit(*data, **FIT)

    assert not engine.model.built and not reference.built  # never called
    assert_every_variable_moved_alike(engine.model, reference, before)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=FLOAT64_RTOL)


@pytest.mark.parametrize("cls", [EMAStep, CountStep], ids=["ema", "count"])
def test_with_a_copy_per_tower_every_copy_assigns_one_devices_value(cls):
    x, y = regression(23)
    engine = Towers(lambda: built(cls), devices=devices(3), placement="replicated")
    reference = built(cls)
    before = [v.numpy() for v in reference.variables]

    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)

    assert_every_variable_moved_alike(engine.model, reference, before)
    for copy in engine.placement.models[1:]:
        for mine, first in zip(copy.variables, engine.model.variables):
            np.testing.assert_array_equal(mine.numpy(), first.numpy(), mine.path)


def test_with_a_copy_per_tower_a_value_of_each_shard_is_refused_by_name():
    x, y = regression(16)
    engine = Towers(
        lambda: built(AugmentStep), devices=devices(2), placement="replicated"
    )
    with pytest.raises(ValueError, match="variable '.*p' is assigned.*towers.gather"):
        engine.fit(x, y, **FIT)
    assert int(engine.model.optimizer.iterations) == 0


class SumTracked(Follower):
    """A step whose loss sums over its batch, fed to a Mean tracker."""

    def loss_of(self, x, y):
        return keras.ops.sum((self.network(x, training=True) - y) ** 2)

    def call(self, x):
        return self.network(x)


def test_a_tracker_fed_a_sum_loss_is_updated_once_with_the_towers_sum():
    x, y = regression(23)
    engine = Towers(built(SumTracked), devices=devices(3))
    reference = built(SumTracked)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    assert_every_variable_moved_alike(engine.model, reference, before)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=FLOAT64_RTOL
    )


class RunningLossStep(keras.Model):
    """A step that adds its loss to a running total it reports, kept in a
    Keras variable or, as keras.io's forward-forward keeps it, in a raw
    tf.Variable that ``model.variables`` does not list."""

    def __init__(self, reduce="mean", raw=False):
        super().__init__()
        self.network, self.reduce = network(), getattr(keras.ops, reduce)
        if raw:
            self.total = tf.Variable(0.0, trainable=False, dtype=tf.float64)
        else:
            self.total = self.add_weight(shape=(), initializer="zeros", name="total")

    def call(self, x):
        return self.network(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.reduce((self.network(x, training=True) - y) ** 2)
        weights = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(loss, weights), weights)
        self.total.assign_add(loss)
        return {"total": self.total / 1.0}


@pytest.mark.parametrize("raw", [False, True], ids=["keras", "raw"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_a_running_total_of_the_loss_adds_the_batchs_loss_once(reduce, raw):
    x, y = regression(23)
    engine = Towers(built(lambda: RunningLossStep(reduce, raw)), devices=devices(3))
    reference = built(lambda: RunningLossStep(reduce, raw))
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    assert_every_variable_moved_alike(engine.model, reference, before)
    np.testing.assert_allclose(
        float(engine.model.total), float(reference.total), rtol=FLOAT64_RTOL
    )
    np.testing.assert_allclose(
        history.history["total"], expected.history["total"], rtol=FLOAT64_RTOL
    )


class RawMaxStep(RunningLossStep):
    """A raw tf.Variable assigned a statistic of the batch's rows that is no
    loss: each tower's differs, one device's is the whole batch's."""

    def train_step(self, data):
        logs = super().train_step(data)
        self.largest.assign(tf.reduce_max(data[0]))
        return logs

    def __init__(self):
        super().__init__(raw=True)
        self.largest = tf.Variable(0.0, trainable=False, dtype=tf.float64)


def test_a_raw_variable_assigned_a_statistic_of_each_shard_is_refused_by_name():
    x, y = regression(16)
    engine = Towers(built(RawMaxStep), devices=devices(2))
    before = [v.numpy() for v in engine.model.variables]
    with pytest.raises(ValueError, match="variable '.*/largest' is assigned"):
        engine.fit(x, y, **FIT)
    for b, v in zip(before, engine.model.variables):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert float(engine.model.largest) == float(engine.model.total) == 0.0

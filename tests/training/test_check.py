"""The first step checked against one device's (towers/training/check.py):
a model whose forward pass couples the batch in a way no rule of towers
covers is named before any update, rounding raises no alarm, and
``Towers.check`` shows every variable (issue 64)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.training.test_keras_fit_cases import assert_same_fit, twins
from towers import Towers


class CentredOverTheBatch(keras.layers.Layer):
    """Centres each feature over the batch's examples: every output reads
    every example, which no rule of towers knows."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


def centring():
    inputs = keras.Input((4,))
    hidden = CentredOverTheBatch()(keras.layers.Dense(6, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def regression(count=30, features=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, features)).astype("float32")
    return x, rng.standard_normal((count, 1)).astype("float32")


def sgd_mse():
    return dict(optimizer=keras.optimizers.SGD(0.1), loss="mse")


def test_a_coupling_no_rule_covers_is_refused_by_name_before_any_update(float64):
    # 5-8 % apart: in float64, where the check refuses past rounding's 1e-7;
    # float32's rounding reaches 6.7 % on MobileNetV2 (check.py's RTOL).
    x, y = regression()
    model = twins(centring, sgd_mse)[0]
    before = [v.numpy() for v in model.variables]
    engine = Towers(model, devices=devices(3))

    with pytest.raises(ValueError, match="not one device's") as refused:
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)

    message = str(refused.value)
    kernel = model.layers[1].kernel  # the variable and its layer, named
    assert f"{kernel.path} (layer {model.layers[1].path})" in message, message
    assert "relative" in message
    # and why: the layer from which the outputs couple, what to do.
    coupling = model.layers[2]
    assert isinstance(coupling, CentredOverTheBatch)
    assert f"couples the batch's examples from layer {coupling.name!r}" in message
    assert "coupled_losses='per_tower'" in message
    for var, value in zip(model.variables, before):  # nothing was updated
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)
    assert int(engine.optimizer.iterations) == 0 and engine.steps_done == 0


def test_without_the_check_the_same_model_trains_to_other_weights():
    # What the check stands between: towers' step alone is not one device's.
    x, y = regression()
    mine, model = twins(centring, sgd_mse)
    engine = Towers(mine, devices=devices(3), check_first_step=False)
    with pytest.raises(AssertionError):
        assert_same_fit(engine, model, x, y, batch_size=10, epochs=1)


def test_taking_it_per_tower_is_the_opt_in_and_is_warned_of():
    x, y = regression()
    engine = Towers(twins(centring, sgd_mse)[0], devices=devices(3),
                    coupled_losses="per_tower")  # fmt: skip
    with pytest.warns(UserWarning, match="coupled_losses='per_tower'"):
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert engine.steps_done == 3


def test_one_tower_passes_the_check_and_trains_as_keras_fit():
    x, y = regression()
    mine, model = twins(centring, sgd_mse)
    assert_same_fit(Towers(mine, devices=devices(1)), model, x, y, epochs=1)


def test_check_shows_every_variables_difference_and_keeps_nothing():
    x, y = regression(count=10)
    model = twins(centring, sgd_mse)[0]
    engine = Towers(model, devices=devices(3))
    before = [v.numpy() for v in model.variables]

    comparison = engine.check(x, y)

    table = str(comparison)
    for var in model.variables:
        assert var.path in table
    named = {d.path for d in comparison.differs}
    first, last = model.layers[1], model.layers[-1]
    assert {first.kernel.path, first.bias.path, last.kernel.path} <= named, table
    # At a prompt its value is the table, led by its verdict.
    assert repr(comparison) == table
    verdict = table.splitlines()[0]
    assert verdict.startswith(f"NOT one device's step: {len(named)} variables"), table
    for var, value in zip(model.variables, before):
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)
    assert int(engine.optimizer.iterations) == 0 and engine.steps_done == 0


def test_an_own_steps_optimizers_built_at_its_apply_are_checked_eagerly(monkeypatch):
    # A GAN's two optimizers are built at their first apply: the check runs
    # the step eagerly as the reference (no trace), building them at their
    # first apply, and compares every variable, slots included; nothing is
    # kept (the slots it made are put back to their first values).
    from tests.step.work.test_own import gan
    from towers.training import one_device

    traced = []
    own = one_device.OneDevice.__init__

    def made(self, *args, **kwargs):
        own(self, *args, **kwargs)
        traced.append(self.traced)

    monkeypatch.setattr(one_device.OneDevice, "__init__", made)
    model = gan()
    engine = Towers(model, devices=devices(2))
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((8, 2)), rng.standard_normal((8, 3))
    before = [v.numpy() for v in model.variables]

    comparison = engine.check(real, z)

    assert comparison.skipped is None and comparison.differs == [], str(comparison)
    assert traced == [False]
    paths = {d.path for d in comparison.differences}
    optimizers = (model.d_optimizer, model.g_optimizer)
    slots = [v.path for o in optimizers for v in o.variables]
    assert model.d_optimizer.built and model.g_optimizer.built
    assert {p for p in slots if "iteration" not in p} <= paths, str(comparison)
    for var, value in zip(model.variables, before):
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)
    for optimizer in optimizers:
        assert int(optimizer.iterations) == 0
        for var in optimizer.variables:
            assert not np.any(var.numpy()) or "learning_rate" in var.path, var.path


def bias_before_batch_norm():
    """A Dense bias followed by BatchNormalization: its true gradient is
    zero, and float32 sums leave noise Adam scales to a full step."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.ReLU()(hidden)))


def test_rounding_raises_no_alarm_with_adam_in_float32():
    x, y = regression(count=48)
    y = np.concatenate([y, -y], axis=1)
    model = twins(bias_before_batch_norm, lambda: dict(optimizer="adam", loss="mse"))[0]
    engine = Towers(model, devices=devices(3))

    comparison = engine.check(x, y)

    assert comparison.differs == [], str(comparison)
    bias = model.layers[1].bias.path
    noise = [d for d in comparison.differences if d.path == bias]
    assert noise[0].noise == 8, str(comparison)  # every element left out
    engine.fit(x, y, batch_size=16, epochs=1, verbose=0)  # checked, no alarm
    assert engine.steps_done == 3


class StatefulNoise(keras.layers.Layer):
    def call(self, x, training=False):
        return x + tf.random.normal(tf.shape(x)) if training else x


def test_a_step_it_cannot_compare_is_said_once_and_trains():
    inputs = keras.Input((4,))
    noisy = StatefulNoise()(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(noisy))
    model.compile(**sgd_mse())
    engine = Towers(model, devices=devices(2))
    x, y = regression(count=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit(x, y, batch_size=4, epochs=2, verbose=0)
    said = [w for w in caught if "first step was not compared" in str(w.message)]
    assert len(said) == 1 and "standard_normal" in str(said[0].message)
    assert engine.steps_done == 4


class MaskedKernel(keras.layers.Layer):
    """keras.io's PixelCNN's shape: ``call()`` masks its kernel by assigning
    it; one device then applies the gradient to the masked kernel."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 3))
        self.mask = np.tril(np.ones((shape[-1], 3), "float32"))

    def call(self, x):
        self.kernel.assign(self.kernel * self.mask)
        return x @ self.kernel


def masked():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(1)(MaskedKernel()(inputs)))


def spectral():
    inputs = keras.Input((4,))
    hidden = keras.layers.SpectralNormalization(keras.layers.Dense(5))(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


@pytest.mark.parametrize("num_towers", [1, 3])
@pytest.mark.parametrize("build", [masked, spectral], ids=["masked", "spectral"])
def test_a_trainable_variable_the_forward_pass_assigns_trains_as_on_one_device(
    build, num_towers
):
    x, y = regression()
    mine, model = twins(build, lambda: dict(optimizer="adam", loss="mse"))
    engine = Towers(mine, devices=devices(num_towers), check_first_step=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aggregation='none' named
        assert_same_fit(engine, model, x, y, epochs=2)


class RecommenderNet(keras.Model):
    """keras.io's collaborative filtering model as written: its
    ``ops.tensordot(user, movie, 2)`` sums over the batch axis too, so every
    prediction reads every example."""

    def __init__(self, users=10, movies=12, size=4):
        super().__init__()
        self.user_embedding = keras.layers.Embedding(users, size)
        self.user_bias = keras.layers.Embedding(users, 1)
        self.movie_embedding = keras.layers.Embedding(movies, size)
        self.movie_bias = keras.layers.Embedding(movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = keras.ops.tensordot(user_vector, movie_vector, 2)
        return keras.ops.sigmoid(dot_user_movie + user_bias + movie_bias)


def ratings(count=30, seed=0):
    rng = np.random.default_rng(seed)
    pairs = np.stack([rng.integers(0, 10, count), rng.integers(0, 12, count)], 1)
    return pairs.astype("int32"), rng.random((count, 1)).astype("float32")


def recommender_twins():
    return twins(
        RecommenderNet,
        lambda: dict(
            optimizer=keras.optimizers.Adam(0.001), loss="binary_crossentropy"
        ),
        ratings(2)[0],
    )


def test_keras_ios_collaborative_filtering_is_refused_by_name_on_towers():
    x, y = ratings()
    engine = Towers(recommender_twins()[0], devices=devices(3))
    with pytest.raises(ValueError, match="couples the batch's examples from layer "
                       "'RecommenderNet'"):  # fmt: skip
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert engine.steps_done == 0


def test_keras_ios_collaborative_filtering_trains_as_keras_fit_on_one_tower():
    x, y = ratings()
    mine, model = recommender_twins()
    assert_same_fit(Towers(mine, devices=devices(1)), model, x, y, batch_size=10)


class CentredWhenOn(keras.layers.Layer):
    """Centres over the batch once its Python flag is on: what a trace of
    the step reads from the layer's state, fixed until the step retraces."""

    on = False

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True) if self.on else x


def centring_when_on():
    inputs = keras.Input((4,))
    hidden = CentredWhenOn()(keras.layers.Dense(6, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def test_a_new_trace_of_the_step_is_checked_on_its_first_batch(float64):
    x, y = regression()
    model = twins(centring_when_on, sgd_mse)[0]
    engine = Towers(model, devices=devices(3))
    engine.fit(x[:20], y[:20], batch_size=10, epochs=1, verbose=0, shuffle=False)
    model.layers[2].on = True  # the next trace couples the batch
    before = [v.numpy() for v in model.variables]
    with pytest.raises(ValueError, match="not one device's") as refused:
        # 12 examples: a new shape, so a new trace, checked before its update.
        engine.fit(x[:12], y[:12], batch_size=12, epochs=1, verbose=0)
    message = str(refused.value)
    assert "step 3 (a new trace of the step: new shapes or trainables) is" in message
    coupling = model.layers[2].name  # and the layer where the outputs couple
    assert f"couples the batch's examples from layer {coupling!r}" in message
    for var, value in zip(model.variables, before):  # nothing was updated
        np.testing.assert_array_equal(var.numpy(), value, err_msg=var.path)
    assert engine.steps_done == 2


class CentredAfter(keras.layers.Layer):
    """Centres over the batch from its fourth call on: a coupling a step
    counter switches on after the first step was checked."""

    def build(self, input_shape):
        self.calls = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="calls"
        )

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1.0)
        centred = x - keras.ops.mean(x, axis=0, keepdims=True)
        return keras.ops.where(self.calls > 3.0, centred, x)


def centring_after():
    inputs = keras.Input((4,))
    hidden = CentredAfter()(keras.layers.Dense(6, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def test_a_spot_check_stops_a_step_that_changed_since_the_first(float64):
    x, y = regression(count=60)
    model = twins(centring_after, sgd_mse)[0]
    engine = Towers(model, devices=devices(3), spot_checks=5)
    with pytest.raises(ValueError, match="not one device's") as refused:
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
    message = str(refused.value)
    assert "step 5 (a spot check, every 5 steps)" in message
    assert f"from layer {model.layers[2].name!r}" in message
    # Steps 1-4 trained (the first checked, the coupling off until the 4th
    # call), step 5 was put back whole.
    assert engine.steps_done == 4 and int(engine.optimizer.iterations) == 4
    assert float(model.layers[2].calls.numpy()) == 4.0


def test_without_spot_checks_the_switched_coupling_trains_on():
    x, y = regression(count=60)
    engine = Towers(twins(centring_after, sgd_mse)[0], devices=devices(3),
                    spot_checks=None)  # fmt: skip
    engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
    assert engine.steps_done == 6


@pytest.mark.parametrize("every", [0, -3, 2.5, True, "often"])
def test_spot_checks_take_a_number_of_steps_or_none(every):
    with pytest.raises(ValueError, match=f"received {every!r}"):
        Towers(centring, loss="mse", optimizer="sgd", devices=devices(2),
               spot_checks=every)  # fmt: skip


class GradientsByRows(keras.Model):
    """An own train_step that scales its gradients by the rows it sees: no
    rule of towers reads that, and its outputs couple nothing."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        rows = tf.cast(tf.shape(x)[0], loss.dtype) / 10.0
        grads = [g * rows for g in tape.gradient(loss, self.trainable_variables)]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_difference_no_rule_explains_names_its_layers_and_what_to_do(float64):
    x, y = regression()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    model = GradientsByRows(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(**sgd_mse())
    engine = Towers(model, devices=devices(2))
    with pytest.raises(ValueError, match="No rule towers has explains it") as refused:
        engine.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
    message = str(refused.value)
    assert "towers' step at its first step is not one device's" in message
    assert "what differs is in layer hidden, layer out" in message, message
    assert "Train this model on one device, or pass check_first_step=False" in message
    assert int(engine.optimizer.iterations) == 0


def test_a_check_that_finds_nothing_says_so_first():
    x, y = regression(count=10)
    engine = Towers(twins(centring, sgd_mse)[0], devices=devices(1))
    table = repr(engine.check(x, y))
    assert table.startswith("one device's step, within rounding (largest: "), table
    assert "DIFFERS" not in table

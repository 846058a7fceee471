"""The towers' gradients as one device's (towers/step/rules/grad_rules.py): a lookup
of rows apart from the batch (keras.io's position embeddings) is combined
as one device's gradient, so Adam, which squares each slice, takes the same
step (issue 64, item 3)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.step.work.test_own import GuideStep
from tests.test_equivalence import devices
from tests.training.test_keras_fit_cases import assert_same_fit, twins
from towers import Towers
from towers.step.rules.forms import Reads
from towers.step.rules.grad_rules import as_one_devices


class TokensAndPositions(keras.Model):
    """keras.io's TokenAndPositionEmbedding: tokens from the batch, positions
    from ``arange`` over the sequence's length."""

    def __init__(self):
        super().__init__()
        self.tokens = keras.layers.Embedding(20, 4)
        self.positions = keras.layers.Embedding(6, 4)
        self.out = keras.layers.Dense(1)

    def call(self, ids):
        positions = keras.ops.arange(keras.ops.shape(ids)[1])
        embedded = self.tokens(ids) + self.positions(positions)
        return self.out(keras.ops.mean(embedded, axis=1))


@pytest.mark.parametrize("num_towers", [2, 3])
def test_position_embeddings_train_with_adam_as_keras_fit(num_towers):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (30, 6)).astype("int32")
    y = rng.random((30, 1)).astype("float32")
    mine, model = twins(
        TokensAndPositions,
        lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="mse"),
        x[:2],
    )
    engine = Towers(mine, devices=devices(num_towers), check_first_step=False)
    assert_same_fit(engine, model, x, y, batch_size=10)


class OwnStep(TokensAndPositions):
    """The same model with the guide's own train_step: its apply combines
    the towers' gradients by the same rules."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.metrics[0].update_state(loss)
        return {"loss": self.metrics[0].result()}


def test_position_embeddings_in_an_own_train_step_train_with_adam_as_keras_fit():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (30, 6)).astype("int32")
    y = rng.random((30, 1)).astype("float32")
    mine, model = twins(
        OwnStep, lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="mse"), x[:2]
    )
    assert_same_fit(Towers(mine, devices=devices(3)), model, x, y, batch_size=10)


def test_the_towers_slices_of_rows_apart_from_the_batch_are_summed_in_one():
    variables = [keras.Variable(np.zeros((3, 2)))] * 2

    @tf.function(autograph=False)
    def slices(x):
        grads = []
        for shard in tf.split(x, 2):
            rows = tf.range(tf.shape(shard)[1])  # positions: not the batch's
            tokens = tf.cast(shard[:, 0], tf.int32)  # the batch's values
            grads.append([
                tf.IndexedSlices(tf.ones((3, 2)), rows, (3, 2)),
                tf.IndexedSlices(tf.ones((2, 2)), tokens, (3, 2)),
            ])  # fmt: skip
        merged = as_one_devices(grads, variables, x)
        return (merged[0][0].values, merged[1][0] is None,
                merged[0][1].values, merged[1][1].values)  # fmt: skip

    positions, second_gone, tokens_0, tokens_1 = slices(tf.zeros((4, 3)))
    np.testing.assert_array_equal(positions, np.full((3, 2), 2.0))  # summed
    assert bool(second_gone)
    np.testing.assert_array_equal(tokens_0, np.ones((2, 2)))  # kept apart
    np.testing.assert_array_equal(tokens_1, np.ones((2, 2)))


def test_indices_read_the_batch_through_a_called_function():
    inner = tf.function(
        lambda x: (tf.range(tf.shape(x)[1]), tf.cast(x[:, 0], tf.int32)),
        autograph=False,
    )

    found = []

    @tf.function(autograph=False)
    def outer(x):
        rows, tokens = inner(x)
        reads = Reads([x], shapes=False)
        found.extend([reads(rows), reads(tokens)])
        return rows

    outer(tf.zeros((2, 3)))
    assert found == [False, True]


def float8_model(kind=keras.Model):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kind(inputs, keras.layers.Dense(1)(hidden))
    model.quantize("float8")
    return model


def test_float8_scales_and_histories_take_one_devices_values():
    # Keras' own fit assigns each scale and amax history the value its
    # "gradient" holds; towers takes the towers' largest, one device's. The
    # other weights train in float8 (2 bits of significand in the upstream
    # gradients): rounding apart, hence the tolerance.
    x, y = regression_data()
    with pytest.warns(UserWarning, match="quantize"):  # Keras: InputLayer
        mine, model = twins(float8_model, lambda: dict(optimizer="sgd", loss="mse"))
    engine = Towers(mine, devices=devices(3))
    fit = dict(batch_size=10, epochs=2, verbose=0, shuffle=False)
    engine.fit(x, y, **fit)
    model.fit(x, y, **fit)

    overwritten = [v for v in model.variables if v.overwrite_with_gradient]
    assert len(overwritten) == 12  # 3 scales and 3 histories per layer
    for got, want in zip(mine.variables, model.variables):
        rtol = 1e-3 if want.overwrite_with_gradient else 1e-2
        np.testing.assert_allclose(
            got.numpy(), want.numpy(), rtol=rtol, err_msg=want.path
        )


def test_float8_training_is_one_devices_where_rounding_cannot_hide_it(float64):
    # Quantized from float64, no value lies within a rounding of a float8
    # boundary, so what is left is the mechanism: the shared scales, each
    # tower's shard quantized with them, and the histories' maximum. Adam
    # over 8 steps on 3 uneven towers ends where Keras' fit ends.
    x, y = regression_data(80)

    def compiled():
        keras.utils.set_random_seed(0)
        with pytest.warns(UserWarning, match="quantize"):  # Keras: InputLayer
            model = float8_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    mine, model = compiled(), compiled()
    assert str(mine.layers[1].dtype_policy.name) == "float8_from_float64"
    fit = dict(batch_size=10, epochs=1, verbose=0, shuffle=False)
    model.fit(x, y, **fit)
    Towers(mine, devices=devices(3)).fit(x, y, **fit)
    for got, want in zip(mine.variables, model.variables, strict=True):
        np.testing.assert_allclose(
            got.numpy(), want.numpy(), rtol=1e-12, atol=1e-15, err_msg=want.path
        )
    for got, want in zip(mine.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(
            got.numpy(), want.numpy(), rtol=1e-12, atol=1e-15, err_msg=want.path
        )


def test_float8_in_an_own_train_step_is_refused_by_name_before_any_update():
    # The tape's gradients in a model's own step are a mean's over each
    # tower's rows (step/rules/loss_kinds.py), so the output gradients' amax
    # histories hold a shard's magnitudes, not one device's: the first-step
    # check names them, and nothing moves.
    x, y = regression_data()
    build = functools.partial(float8_model, GuideStep)
    with pytest.warns(UserWarning, match="quantize"):  # Keras: InputLayer
        mine, _ = twins(build, lambda: dict(optimizer="sgd", loss="mse"))
    before = [v.numpy() for v in mine.variables]
    with pytest.raises(ValueError, match="outputs_grad_amax_history"):
        Towers(mine, devices=devices(3)).fit(x, y, batch_size=10, verbose=0)
    for variable, value in zip(mine.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value, variable.path)


def regression_data(count=30, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((count, 4)).astype("float32")
    return x, rng.random((count, 1)).astype("float32")

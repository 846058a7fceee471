"""What a Keras user brings, exact against Keras itself on one device.

The reference is Keras' own ``model.compile(...)`` and ``train_on_batch`` on the
whole batch (its compile-loss: sample weights, per-output losses and weights,
add_loss), and towers must give the same weights (float32, rtol 1e-5).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import ADAM_EPSILON, EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01, epsilon=ADAM_EPSILON),
}
SIZES = [13, 7, 1, 10]  # uneven; 1 leaves towers empty


def classifier():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def two_outputs():
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    label = keras.layers.Dense(3, name="label")(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    return keras.Model(inputs, [label, value])


def twin(builder, engine):
    """A copy of the engine's model with its weights, for Keras to train."""
    model = builder()
    model.set_weights(engine.model.get_weights())
    return model


def assert_same_weights(engine, reference):
    for got, want, var in zip(
        engine.model.get_weights(), reference.get_weights(), reference.weights
    ):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=var.path
        )


def data(seed, sizes=SIZES):
    rng = np.random.default_rng(seed)
    for size in sizes:
        x = rng.standard_normal((size, 6)).astype("float32")
        y = rng.integers(0, 3, size).astype("int32")
        weights = rng.random(size).astype("float32")
        yield x, y, weights


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sample_weights_train_as_keras_does_on_one_device(num_towers, optimizer):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = Towers(classifier, loss, OPTIMIZERS[optimizer], devices(num_towers))
    reference = twin(classifier, engine)
    reference.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss)

    for step, (x, y, weights) in enumerate(data(num_towers)):
        if step == 1:
            weights[:] = 0.0  # a batch that weighs nothing changes nothing
        if step == 3:
            weights[:2] = 0.0  # tower 0's weights are all zero
        logs = engine.train_step(x, y, weights)
        expected = reference.train_on_batch(x, y, sample_weight=weights)
        np.testing.assert_allclose(float(logs["loss"]), expected, rtol=1e-5, atol=1e-7)

    assert_same_weights(engine, reference)


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_per_output_losses_and_loss_weights_train_as_keras_does(num_towers, optimizer):
    losses = {
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "value": "mse",
    }
    loss_weights = {"label": 1.0, "value": 0.3}
    engine = Towers(
        two_outputs,
        losses,
        OPTIMIZERS[optimizer],
        devices(num_towers),
        loss_weights=loss_weights,
    )
    reference = twin(two_outputs, engine)
    reference.compile(
        optimizer=OPTIMIZERS[optimizer](), loss=losses, loss_weights=loss_weights
    )

    for x, y, weights in data(num_towers + 20):
        targets = {"label": y, "value": weights[:, None] * 3.0}
        engine.train_step(x, targets, weights)
        reference.train_on_batch(x, targets, sample_weight=weights)

    assert_same_weights(engine, reference)


class Autoencoder(keras.Model):
    """Adds its own loss: the reconstruction's mean squared error."""

    def __init__(self):
        super().__init__()
        self.encode = keras.layers.Dense(3, activation="tanh")
        self.decode = keras.layers.Dense(6)

    def call(self, x):
        reconstruction = self.decode(self.encode(x))
        self.add_loss(keras.ops.mean(keras.ops.square(x - reconstruction)))
        return reconstruction


def autoencoder():
    model = Autoencoder()
    model(np.zeros((1, 6), "float32"))
    return model


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_model_that_adds_its_own_loss_trains_on_x_alone(num_towers, optimizer):
    engine = Towers(autoencoder, None, OPTIMIZERS[optimizer], devices(num_towers))
    reference = twin(autoencoder, engine)
    reference.compile(optimizer=OPTIMIZERS[optimizer]())

    for x, _, _ in data(7):
        engine.train_step(x)
        reference.train_on_batch(x)

    assert_same_weights(engine, reference)


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
def test_fit_with_class_weight_trains_as_keras_fit(num_towers):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((40, 6)).astype("float32")
    y = rng.integers(0, 3, 40).astype("int32")
    class_weight = {0: 1.0, 1: 3.0, 2: 0.5}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = Towers(classifier, loss, OPTIMIZERS["sgd"], devices(num_towers))
    reference = twin(classifier, engine)
    reference.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)

    history = engine.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        class_weight=class_weight,
        shuffle=False,
    )
    reference.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        class_weight=class_weight,
        shuffle=False,
    )

    assert_same_weights(engine, reference)
    assert len(history.history["loss"]) == 2


def test_a_compiled_model_brings_its_loss_optimizer_and_metrics():
    model = classifier()
    model.compile(
        optimizer=OPTIMIZERS["sgd"](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )
    reference = twin(classifier, type("E", (), {"model": model})())
    reference.compile(
        optimizer=OPTIMIZERS["sgd"](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    engine = Towers(model, devices=devices(2))
    for x, y, _ in data(9):
        logs = engine.train_step(x, y)
        reference.train_on_batch(x, y)

    assert engine.optimizer is model.optimizer
    # The model's own metric objects, listed as Keras lists them.
    assert engine.metrics == model.metrics
    assert model.metrics_names == ["loss", "compile_metrics"]
    assert "sparse_categorical_accuracy" in logs
    assert "sparse_categorical_accuracy" in model.get_metrics_result()
    assert_same_weights(engine, reference)


def test_explicit_arguments_win_over_the_compiled_ones():
    model = classifier()
    model.compile(optimizer="adam", loss="mse")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    engine = Towers(model, loss, keras.optimizers.SGD(0.1), devices=devices(2))

    assert type(engine.optimizer).__name__ == "SGD"
    x, y, _ = next(data(10))
    expected = float(loss(y, engine.model(x)))  # before the step's update
    assert float(engine.train_step(x, y)["loss"]) == pytest.approx(expected, rel=1e-6)


def test_an_uncompiled_model_predicts_and_fit_asks_for_a_compile():
    model = classifier()
    engine = Towers(model, devices=devices(2))
    x, y, _ = next(data(7))

    # As Keras: predict needs no compile; fit and evaluate need a loss.
    np.testing.assert_allclose(
        engine.predict(x, verbose=0),
        model.predict(x, verbose=0),
        rtol=EQUIVALENCE_RTOL,
        atol=EQUIVALENCE_ATOL,
    )
    for call in (engine.fit, engine.evaluate):
        with pytest.raises(ValueError) as error:
            call(x, y, verbose=0)
        assert str(error.value) == (
            f"Towers.{call.__name__} needs a loss and an optimizer; received a "
            "model that was not compiled and neither. Call model.compile("
            "optimizer=..., loss=...) before Towers, or pass loss= and optimizer= "
            "to Towers (predict needs neither)."
        )
    assert not model.compiled


def test_fit_takes_arrays_returns_a_history_and_predict_keeps_the_order():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((23, 6)).astype("float32")
    y = rng.integers(0, 3, 23).astype("int32")
    engine = Towers(
        classifier,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        OPTIMIZERS["sgd"],
        devices(4),
    )

    history = engine.fit(x, y, batch_size=10, epochs=2, verbose=0)
    predictions = engine.predict(x, batch_size=10)

    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == [0, 1] and len(history.history["loss"]) == 2
    np.testing.assert_allclose(
        predictions, engine.model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(sample_weight=np.ones(5, "float32")),
            "x and y and sample_weight must have the same batch size; received x "
            "with 8 examples and y with 8 and sample_weight with 5",
        ),
    ],
)
def test_bad_sample_weights_are_refused_and_nothing_is_applied(kwargs, message):
    engine = Towers(classifier, "mse", OPTIMIZERS["sgd"], devices(2))
    before = engine.model.get_weights()
    x, y = np.zeros((8, 6), "float32"), np.zeros((8, 3), "float32")

    with pytest.raises(ValueError) as error:
        engine.train_step(x, y, **kwargs)

    assert str(error.value) == message
    for a, b in zip(before, engine.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(engine.optimizer.iterations.numpy()) == 0


def test_a_loss_dict_naming_an_output_the_model_lacks_is_refused():
    # Known from the model's output names before any batch.
    with pytest.raises(ValueError, match=r"received \['score'\], the model's outputs"):
        Towers(
            two_outputs, {"label": "mse", "score": "mae"}, OPTIMIZERS["sgd"], devices(2)
        )


def test_loss_none_with_a_model_that_adds_no_loss_is_refused():
    engine = Towers(classifier, None, OPTIMIZERS["sgd"], devices(2))
    x, _, _ = next(data(13))

    with pytest.raises(ValueError, match="loss=None needs a model that adds its own"):
        engine.train_step(x)
    assert int(engine.optimizer.iterations.numpy()) == 0


def layered():
    """Three Dense layers of one shape, so a gradient paired with the wrong
    variable would fit it (the bug a stale trainable list caused)."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(6, activation="tanh", name="d0"),
            keras.layers.Dense(6, activation="tanh", name="d1"),
            keras.layers.Dense(6, name="d2"),
        ]
    )


def one_device_trainer(model, optimizer):
    """The one-device reference: GradientTape on the whole batch; the optimizer
    has slots for every layer's variables, as towers builds it."""
    optimizer.build(model.weights)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return step


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("new_shape", [False, True])
def test_a_trainable_change_between_steps_trains_the_new_set(
    num_towers, optimizer, new_shape
):
    engine = Towers(layered, "mse", OPTIMIZERS[optimizer], devices(num_towers))
    reference = twin(layered, engine)
    step = one_device_trainer(reference, OPTIMIZERS[optimizer]())
    rng = np.random.default_rng(14)
    x = rng.standard_normal((12, 6)).astype("float32")
    y = rng.standard_normal((12, 6)).astype("float32")

    plan = [("d1", False), ("d1", True), ("d0", False), ("d2", False), ("d0", True)]
    for layer, trainable in plan:
        for model in (engine.model, reference):
            model.get_layer(layer).trainable = trainable
        rows = slice(0, 11 if new_shape else 12)
        engine.train_step(x[rows], y[rows])
        step(tf.constant(x[rows]), tf.constant(y[rows]))

    assert_same_weights(engine, reference)
    assert int(engine.optimizer.iterations.numpy()) == len(plan)


def test_a_frozen_layer_does_not_move_and_an_unfrozen_one_does():
    engine = Towers(layered, "mse", OPTIMIZERS["sgd"], devices(2))
    x, y = np.ones((4, 6), "float32"), np.zeros((4, 6), "float32")
    engine.model.get_layer("d1").trainable = False
    frozen = engine.model.get_layer("d1").get_weights()

    engine.train_step(x, y)
    for a, b in zip(frozen, engine.model.get_layer("d1").get_weights()):
        np.testing.assert_array_equal(a, b)

    engine.model.get_layer("d1").trainable = True
    engine.train_step(x, y)  # the same shapes: no retrace without the change
    moved = engine.model.get_layer("d1").get_weights()
    assert not np.allclose(frozen[0], moved[0])
    assert engine.trace_count == 2


def test_copies_follow_a_trainable_change_and_stay_identical():
    engine = Towers(
        layered, "mse", OPTIMIZERS["adam"], devices(3), placement="replicated"
    )
    x, y = np.ones((6, 6), "float32"), np.zeros((6, 6), "float32")
    engine.train_step(x, y)

    engine.model.get_layer("d1").trainable = False
    engine.train_step(x, y)

    first, *others = engine.placement.models
    for model in others:
        assert not model.get_layer("d1").trainable
        for a, b in zip(first.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_per_output_metrics_are_named_and_valued_as_keras_does():
    compile_args = dict(
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "value": "mse",
        },
        metrics={"label": ["sparse_categorical_accuracy"], "value": ["mae"]},
        weighted_metrics={"value": ["mse"]},
    )
    model = two_outputs()
    model.compile(optimizer=OPTIMIZERS["sgd"](), **compile_args)
    reference = twin(two_outputs, type("E", (), {"model": model})())
    reference.compile(optimizer=OPTIMIZERS["sgd"](), **compile_args)
    engine = Towers(model, devices=devices(3))
    x, y, weights = next(data(15))
    targets = {"label": y, "value": weights[:, None]}

    logs = engine.train_step(x, targets, weights)
    expected = reference.train_on_batch(
        x, targets, sample_weight=weights, return_dict=True
    )

    # The same logs as Keras': each output's loss and metrics, by name.
    assert (
        sorted(logs)
        == sorted(expected)
        == [
            "label_loss",
            "label_sparse_categorical_accuracy",
            "loss",
            "value_loss",
            "value_mae",
            "value_mse",
        ]
    )
    for name in expected:
        np.testing.assert_allclose(float(logs[name]), expected[name], rtol=1e-5)


def test_a_model_with_several_outputs_reports_each_outputs_loss_as_keras():
    losses = {
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "value": "mse",
    }
    loss_weights = {"label": 1.0, "value": 0.3}
    engine = Towers(
        two_outputs, losses, OPTIMIZERS["sgd"], devices(3), loss_weights=loss_weights
    )
    reference = twin(two_outputs, engine)
    reference.compile(
        optimizer=OPTIMIZERS["sgd"](), loss=losses, loss_weights=loss_weights
    )
    x, y, weights = next(data(16))
    targets = {"label": y, "value": weights[:, None]}

    logs = engine.train_step(x, targets, weights)
    expected = reference.train_on_batch(
        x, targets, sample_weight=weights, return_dict=True
    )

    # Keras logs each output's loss unweighted, beside the weighted total.
    for name in ("loss", "label_loss", "value_loss"):
        np.testing.assert_allclose(float(logs[name]), expected[name], rtol=1e-5)

"""Cases from Keras' own fit tests that towers once crashed on, refused or
trained differently in silence, each against Keras' own call on one device
with the same compiled model (issue 39, items 5 and 8-13)."""

import keras
import numpy as np
import pytest
from keras import ops

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from tests.training.test_output_structures import assert_trains_as_keras
from towers import Towers


def assert_close(got, want, name=""):
    np.testing.assert_allclose(
        got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
    )


def twins(build, compile_args, sample=None):
    """Two models with the same weights (built from ``sample`` if they are
    not), each compiled with its own ``compile_args()``."""
    keras.utils.set_random_seed(0)
    mine, theirs = build(), build()
    if sample is not None:
        mine(sample), theirs(sample)
    theirs.set_weights(mine.get_weights())
    if compile_args is not None:
        mine.compile(**compile_args())
        theirs.compile(**compile_args())
    return mine, theirs


def arrays(count=30, seed=1, features=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, features)).astype("float32")
    return x, (x @ rng.standard_normal((features, 3))).astype("float32")


def dense():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


def assert_same_fit(engine, model, x, y, **options):
    options = {**dict(batch_size=8, epochs=2, verbose=0, shuffle=False), **options}
    got, want = engine.fit(x, y, **options), model.fit(x, y, **options)
    assert sorted(got.history) == sorted(want.history)
    for name in want.history:
        assert_close(got.history[name], want.history[name], name)
    for var, theirs in zip(engine.model.weights, model.weights):
        assert_close(var.numpy(), theirs.numpy(), var.path)


@pytest.mark.parametrize("swap", [False, True], ids=["ema", "SwapEMAWeights"])
def test_an_optimizers_moving_average_ends_fit_in_the_weights(swap):
    def compile_args():
        optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.8)
        return dict(optimizer=optimizer, loss="mse")

    mine, model = twins(dense, compile_args)
    x, y = arrays()
    extra = {}
    if swap:  # validation with the moving average's weights, swapped back after
        extra = dict(validation_data=arrays(10, seed=2))
    callbacks = [keras.callbacks.SwapEMAWeights()] if swap else []
    engine = Towers(mine, devices=devices(2))
    options = dict(batch_size=8, epochs=2, verbose=0, shuffle=False, **extra)
    got = engine.fit(x, y, callbacks=callbacks, **options)
    want = model.fit(
        x, y, callbacks=[keras.callbacks.SwapEMAWeights()] * swap, **options
    )

    for name in want.history:
        assert_close(got.history[name], want.history[name], name)
    # As Keras' fit ends: the weights are the moving average, not the last step's.
    for var, theirs in zip(engine.model.weights, model.weights):
        assert_close(var.numpy(), theirs.numpy(), var.path)


class Distiller(keras.Model):
    """keras.io's knowledge distillation: teacher and student made with an
    Input, the Distiller itself never called before fit; a weight of its own
    made in __init__ beside them."""

    def __init__(self, teacher, student):
        super().__init__()
        self.teacher, self.student = teacher, student
        self.temperature = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(3.0), trainable=False
        )

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False
    ):
        teacher = ops.softmax(self.teacher(x, training=False) / self.temperature)
        student = ops.softmax(y_pred / self.temperature)
        distilled = keras.losses.KLDivergence()(teacher, student)
        hard = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, y_pred)
        return 0.2 * hard + 0.8 * distilled * self.temperature**2

    def call(self, x):
        return self.student(x)


def test_a_distiller_never_called_before_fit_is_built_from_the_first_batch():
    def build():
        net = lambda width: keras.Sequential(  # noqa: E731
            [keras.Input((5,)), keras.layers.Dense(width, activation="relu"),
             keras.layers.Dense(3)]
        )  # fmt: skip
        return Distiller(net(8), net(4))

    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.05))

    mine, model = twins(build, compile_args)
    assert mine.variables and not mine.built  # the case that crashed
    x, _ = arrays()
    y = np.random.default_rng(3).integers(0, 3, len(x))
    assert_same_fit(Towers(mine, devices=devices(2)), model, x, y)


def test_an_uncompiled_model_predicts_as_keras_does():
    mine, model = twins(dense, None)
    x, _ = arrays(11)
    engine = Towers(mine, devices=devices(3))
    assert_close(
        engine.predict(x, batch_size=4, verbose=0), model.predict(x, verbose=0)
    )
    assert not mine.compiled


def two_inputs():
    a, b = keras.Input((5,)), keras.Input((5,))
    joined = keras.layers.Concatenate()([a, b])
    return keras.Model([a, b], keras.layers.Dense(3)(joined))


def test_a_tuple_of_arrays_is_the_inputs_of_a_two_input_model_as_in_keras():
    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    mine, model = twins(two_inputs, compile_args)
    (a, y), (b, _) = arrays(), arrays(seed=2)
    engine = Towers(mine, devices=devices(2))
    assert_close(engine.predict((a, b), verbose=0), model.predict((a, b), verbose=0))
    # fit((a, b)) reads the tuple as the inputs, with no targets: as Keras,
    # a model with a loss to compute refuses it.
    with pytest.raises(ValueError, match=r"received a batch without targets"):
        engine.fit((a, b), verbose=0)
    assert_same_fit(engine, model, (a, b), y)


@pytest.mark.parametrize(
    "given, what",
    [
        (keras.layers.Dense(3), "a Dense layer"),
        (lambda inputs: keras.layers.Dense(3)(inputs), "a function that takes"),
        ("resnet", "str 'resnet'"),
    ],
    ids=["layer", "function of inputs", "name"],
)
def test_what_is_not_a_model_or_a_builder_is_refused_by_name(given, what):
    with pytest.raises(ValueError) as error:
        Towers(given, loss="mse", optimizer="sgd", devices=devices(2))
    message = str(error.value)
    assert message.startswith(
        "model must be a keras.Model, or a zero-argument function that builds one; "
        f"received {what}"
    )


class Constant(keras.layers.Layer):
    """Trains nothing: a model of it has no trainable variable (Keras'
    TrainingTestingLayer: the input in training, zeros otherwise)."""

    def call(self, x, training=False):
        return x if training else x * 0


def test_a_model_without_trainable_variables_fits_with_keras_warning():
    def build():
        return keras.Sequential([keras.Input((3,)), Constant()])

    def compile_args():
        return dict(optimizer="rmsprop", loss="mse")

    mine, model = twins(build, compile_args)
    x, y = np.ones((16, 3), "float32"), np.zeros((16, 3), "float32")
    engine = Towers(mine, devices=devices(2))
    with pytest.warns(UserWarning, match="does not have any trainable weights"):
        history = engine.fit(x, y, batch_size=8, verbose=0)
    keras_history = model.fit(x, y, batch_size=8, verbose=0)
    assert history.history["loss"] == keras_history.history["loss"] == [1.0]
    assert int(engine.optimizer.iterations) == int(model.optimizer.iterations) == 0
    assert engine.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0) == 0


def two_outputs():
    inputs = keras.Input((5,))
    return keras.Model(
        inputs, [keras.layers.Dense(3, name="a")(inputs), keras.layers.Dense(2)(inputs)]
    )


@pytest.mark.parametrize("listed", [False, True], ids=["target", "list of one"])
def test_one_target_for_the_one_output_with_a_loss_as_keras_reads_it(listed):
    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.05), loss=["mse", None])

    mine, model = twins(two_outputs, compile_args)
    x, y = arrays()
    y = [y] if listed else y
    assert_same_fit(Towers(mine, devices=devices(2)), model, x, y)


class SumPenalty(keras.layers.Layer):
    """An add_loss term that sums over the batch's examples."""

    def call(self, x):
        self.add_loss(1e-2 * ops.sum(ops.square(x)))
        return x


class MeanPenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(1e-1 * ops.mean(ops.square(x)))
        return x


def test_an_add_loss_term_that_sums_over_the_batch_adds_up_as_on_one_device():
    def build():
        return keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(3), SumPenalty(), MeanPenalty()]
        )

    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    mine, model = twins(build, compile_args)
    x, y = arrays(27)
    engine = Towers(mine, devices=devices(3))
    assert_same_fit(engine, model, x, y)
    assert engine.step.builtin.coupled.sums == [(mine.layers[1].path, 0)]


def test_an_add_loss_sum_is_refused_with_micro_batches_before_any_update():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), SumPenalty()])
    model.compile(optimizer="sgd", loss="mse")
    engine = Towers(model, devices=devices(2), accumulate_steps=2)
    before = [w.numpy() for w in model.weights]
    with pytest.raises(ValueError, match=r"sum over the batch's examples .*accumulate"):
        engine.train_step(*arrays(8))
    for got, want in zip(model.weights, before):
        np.testing.assert_array_equal(got.numpy(), want)


class Watched(keras.Model):
    """Records the ``training`` its compute_loss is called with outside
    Keras' symbolic build (``seen``)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.seen = []

    def call(self, x):
        return self.dense(x)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        if not keras.src.backend.common.symbolic_scope.in_symbolic_scope():
            self.seen.append(training)
        return super().compute_loss(x, y, y_pred, sample_weight, training)


def watched():
    model = Watched()
    model.compile(optimizer="sgd", loss="mse")
    return model, Towers(model, devices=devices(2))


def test_compute_loss_sees_training_true_as_in_keras_fit():
    model, engine = watched()
    engine.fit(*arrays(16), batch_size=8, verbose=0)
    assert model.seen and all(model.seen)  # the probe's calls included
    engine.evaluate(*arrays(16), verbose=0)
    assert model.seen[-1] is False  # evaluate's, as Keras' evaluate


def test_an_evaluation_first_probes_as_keras_evaluate_calls_compute_loss():
    # The probe before a first evaluation calls compute_loss with False, as
    # Keras' evaluate does; it does not stand in for training's probe, whose
    # calls say True as Keras' fit's.
    model, engine = watched()
    engine.evaluate(*arrays(16), batch_size=16, verbose=0)
    assert model.seen and set(model.seen) == {False}
    model.seen.clear()
    engine.fit(*arrays(16), batch_size=16, verbose=0)
    assert model.seen and set(model.seen) == {True}


class RaggedScale(keras.layers.Layer):
    """Ragged rows times a learned scale: a ragged output."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def ragged_model():
    inputs = keras.Input((None,), ragged=True)
    model = keras.Model(inputs, RaggedScale()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=ragged_squared_error)
    return model


def ragged_squared_error(y_true, y_pred):
    # One value for the batch, over every ragged row's values (dense where
    # Keras builds its compiled loss from shapes).
    import tensorflow as tf

    diff = y_true - y_pred
    values = diff.flat_values if isinstance(diff, tf.RaggedTensor) else diff
    return tf.reduce_mean(tf.square(values))


def test_a_ragged_output_trains_and_predicts_as_keras():
    import tensorflow as tf

    rows = [[1.0], [2.0, 3.0], [4.0, 5.0, 6.0], [7.0], [8.0, 9.0]]
    x = tf.ragged.constant(rows)
    y = tf.ragged.constant([[2.5 * v for v in row] for row in rows])
    engine, reference = Towers(ragged_model(), devices=devices(2)), ragged_model()

    engine.fit(x, y, batch_size=5, epochs=3, verbose=0)
    reference.fit(x, y, batch_size=5, epochs=3, verbose=0)
    engine.train_step(x, y)  # shards of known sizes: one trace for both towers
    reference.train_on_batch(x, y)

    np.testing.assert_allclose(
        engine.model.get_weights(), reference.get_weights(), rtol=EQUIVALENCE_RTOL
    )
    got, want = engine.predict(x, batch_size=2), reference.predict(x, batch_size=2)
    assert isinstance(got, tf.RaggedTensor)
    assert got.row_lengths().numpy().tolist() == [1, 2, 3, 1, 2]
    np.testing.assert_allclose(got.flat_values, want.flat_values, rtol=EQUIVALENCE_RTOL)


def test_predict_returns_batches_whose_outputs_differ_in_shape_as_keras():
    # A dynamic length after the batch axis (a spectrogram's frames, say):
    # Keras' predict joins such batches as one ragged tensor.
    def batches():
        for length in (3, 5, 2):
            yield (np.arange(4 * length, dtype="float32").reshape(4, length),)

    inputs = keras.Input((None,))
    model = keras.Model(inputs, keras.layers.Rescaling(2.0)(inputs))
    engine = Towers(model, devices=devices(2))

    got, want = (
        engine.predict(batches(), verbose=0),
        model.predict(batches(), verbose=0),
    )

    assert type(got) is type(want)
    assert got.to_list() == want.to_list()


def test_a_ragged_output_of_a_model_without_weights_fits_and_predicts():
    # Keras' own ragged case: a loss that returns a number, no weights.
    import tensorflow as tf

    inputs = keras.Input((None,), ragged=True)
    model = keras.Model(inputs, keras.layers.Rescaling(2.0)(inputs))
    model.compile(optimizer="adam", loss=lambda y, y_pred, sample_weight=None: 0)
    x = tf.ragged.constant([[1.0], [2.0, 3.0]])
    engine = Towers(model, devices=devices(2))

    with pytest.warns(UserWarning, match="does not have any trainable weights"):
        history = engine.fit(x, x, verbose=0)

    assert history.history["loss"] == [0.0]
    assert engine.predict(x, verbose=0).to_list() == [[2.0], [4.0, 6.0]]


def test_a_distiller_never_compiled_predicts_as_keras():
    # Its own compute_loss is no reason to need an optimizer to predict.
    from keras.distillation import Distiller, LogitsDistillation

    keras.utils.set_random_seed(1)
    teacher, student = (
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(10)]) for _ in "ts"
    )
    distiller = Distiller(
        teacher=teacher,
        student=student,
        distillation_losses=LogitsDistillation(),
        student_loss_weight=0.5,
    )
    x = np.random.default_rng(0).random((11, 5)).astype("float32")
    engine = Towers(distiller, devices=devices(2))

    assert_close(engine.predict(x, verbose=0), distiller.predict(x, verbose=0))
    with pytest.raises(ValueError, match="optimizer"):
        engine.fit(x, np.zeros((11, 10), "float32"), verbose=0)


class AddIfGiven(keras.layers.Layer):
    """A dense view of x, plus y when an optional y is given."""

    def build(self, x_shape, y_shape=None):
        self.dense = keras.layers.Dense(2)
        self.dense.build(x_shape)

    def call(self, x, y=None):
        return self.dense(x) if y is None else self.dense(x) + y

    def compute_output_shape(self, x_shape, y_shape=None):
        return (x_shape[0], 2)


def optional_input_model():
    keras.utils.set_random_seed(6)
    given = keras.Input((2,), name="given")
    maybe = keras.Input((2,), name="maybe", optional=True)
    model = keras.Model({"given": given, "maybe": maybe}, AddIfGiven()(given, maybe))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_an_optional_input_given_none_trains_and_predicts_as_keras():
    x = {"given": np.random.default_rng(0).random((7, 2)), "maybe": None}
    y = np.ones((7, 2))
    engine = Towers(optional_input_model(), devices=devices(2))
    reference = optional_input_model()

    engine.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL)
    assert_close(engine.predict(x, verbose=0), reference.predict(x, verbose=0))


def test_a_required_input_given_none_gets_keras_error():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="not optional"):
        Towers(model, devices=devices(2)).fit([None], np.ones((4, 1)), verbose=0)


def test_an_optional_input_a_generator_gives_as_none_trains_as_keras():
    rng = np.random.default_rng(1)
    batches = [(rng.random((4, 2)), np.ones((4, 2))) for _ in range(3)]

    def generator():
        for x, y in batches:
            yield {"given": x, "maybe": None}, y

    engine = Towers(optional_input_model(), devices=devices(2))
    reference = optional_input_model()
    engine.fit(generator(), epochs=1, verbose=0)
    reference.fit(generator(), epochs=1, verbose=0)

    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL)


def nested_losses_model():
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    first = keras.layers.Dense(1, name="first")(hidden)
    second = keras.layers.Dense(1, name="second", activation="sigmoid")(hidden)
    model = keras.Model(inputs, [first, second])
    # The second output's loss in a list of its own: as Keras' compile takes
    # it, not one loss per output.
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=["mean_squared_error", ["binary_crossentropy"]],
        metrics=["mae", ["mae", "accuracy"]],
        loss_weights=[0.1, 2.0],
    )
    return model


def test_losses_nested_as_keras_compile_takes_them_train_as_keras():
    rng = np.random.default_rng(2)
    x = rng.random((11, 3))
    y = (rng.random((11, 1)), rng.integers(0, 2, (11, 1)).astype("float32"))
    assert_trains_as_keras(nested_losses_model, x, y)  # batches of 4, 2 epochs

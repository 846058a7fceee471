"""A loss term that is not a mean over the batch's examples is found on the
first batch and refused by name, or warned of with ``coupled_losses=
"per_tower"`` (``towers/step/rules/coupled.py``); a coupled ``compute_loss`` is
computed on the whole batch (tests/step/rules/test_gathered_loss.py). Terms that
are means, or do not depend on the examples, train as Keras' own ``fit`` on
one device."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.step.rules import loss_terms

EXAMPLES = 10


class Contrastive(keras.Model):
    """The compiled loss plus an InfoNCE term between each example's outputs
    and its targets: each example's term is a softmax over the whole batch."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        logits = keras.ops.matmul(y_pred, keras.ops.transpose(y)) / 0.5
        labels = keras.ops.arange(keras.ops.shape(y_pred)[0])
        term = keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True
        )
        return loss + keras.ops.mean(term)


class BatchSpread(keras.layers.Layer):
    """Adds the variance of its inputs over the batch: a term of the batch."""

    def call(self, inputs):
        self.add_loss(0.5 * keras.ops.mean(keras.ops.var(inputs, axis=0)))
        return inputs


class MeanPenalty(keras.layers.Layer):
    """Adds a mean over the examples: exact on towers."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def contrastive():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = Contrastive(inputs, keras.layers.Dense(4)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def with_layer(layer):
    def build():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(
                    8,
                    activation="tanh",
                    kernel_regularizer=keras.regularizers.L2(0.01),
                    activity_regularizer=keras.regularizers.L2(0.001),
                ),
                layer(name="term"),
                keras.layers.Dense(4),
            ],
            name="sequential",
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    return build


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, 6)).astype("float32")
    return x, rng.standard_normal((EXAMPLES, 4)).astype("float32")


def updates(model, before):
    return [w - b for w, b in zip(model.get_weights(), before)]


def fit_both(build, num_towers, **options):
    """towers' and Keras' fit from the same weights: their updates."""
    x, y = data()
    engine = Towers(build(), devices=devices(num_towers), **options)
    reference = build()
    reference.set_weights(engine.model.get_weights())
    before = reference.get_weights()
    engine.fit(x, y, batch_size=EXAMPLES, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=EXAMPLES, shuffle=False, verbose=0)
    return updates(engine.model, before), updates(reference, before)


def test_a_contrastive_compute_loss_is_refused_by_name_before_any_update():
    """coupled_losses='refuse' (the default, "exact", computes it on the whole
    batch: tests/step/rules/test_gathered_loss.py)."""
    x, y = data()
    engine = Towers(contrastive(), devices=devices(2), coupled_losses="refuse")
    before = engine.model.get_weights()

    with pytest.raises(ValueError) as refused:
        engine.fit(x, y, batch_size=EXAMPLES, verbose=0)

    message = str(refused.value)
    assert "Contrastive.compute_loss is" in message
    assert "% apart" in message and "coupled_losses='per_tower'" in message
    assert int(engine.optimizer.iterations) == 0
    for got, was in zip(engine.model.get_weights(), before):
        np.testing.assert_array_equal(got, was)


def test_a_contrastive_compute_loss_trains_per_tower_when_asked_and_says_so():
    with pytest.warns(UserWarning, match=r"Contrastive.compute_loss is .*% apart"):
        got, want = fit_both(contrastive, 2, coupled_losses="per_tower")

    # What the warning says: each tower's softmax runs over its own shard, so
    # the update is not one device's.
    last = np.abs(got[-2] - want[-2]).max() / np.abs(want[-2]).max()
    assert last > 0.05, last


def test_a_contrastive_compute_loss_on_one_tower_is_keras_fit():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got, want = fit_both(contrastive, 1)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def test_an_add_loss_term_of_the_batch_is_refused_naming_its_layer():
    x, y = data()
    engine = Towers(with_layer(BatchSpread)(), devices=devices(3))
    with pytest.raises(
        ValueError, match=r"layer sequential/term's add_loss term is .*apart"
    ):
        engine.fit(x, y, batch_size=EXAMPLES, verbose=0)
    assert int(engine.optimizer.iterations) == 0


def test_mean_terms_and_regularisers_pass_the_probe_and_train_as_keras_fit():
    """A mean add_loss term, a weight and an activity regulariser: no warning,
    no refusal, Keras' update."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got, want = fit_both(with_layer(MeanPenalty), 3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


class SumPenalty(keras.layers.Layer):
    """Adds a sum over the examples: each tower's adds up to one device's."""

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(inputs)))
        return inputs


def test_evaluate_before_any_training_refuses_a_term_of_the_batch_by_name():
    # Not a mean of the towers' shares in silence: evaluate probes the first
    # batch as a first training step does.
    x, y = data()
    engine = Towers(with_layer(BatchSpread)(), devices=devices(3))
    with pytest.raises(ValueError, match=r"layer sequential/term's add_loss term"):
        engine.evaluate(x, y, batch_size=EXAMPLES, verbose=0)


@pytest.mark.parametrize("build", [contrastive, with_layer(SumPenalty)])
def test_evaluate_before_any_training_is_keras_evaluate(build):
    # A coupled compute_loss is gathered, a sum taken as a sum, from the
    # first evaluation on.
    x, y = data()
    engine = Towers(build(), devices=devices(3))
    reference = build()
    reference.set_weights(engine.model.get_weights())
    got = engine.evaluate(x, y, batch_size=EXAMPLES, verbose=0)
    want = reference.evaluate(x, y, batch_size=EXAMPLES, verbose=0)
    np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL)


class InKerasTests(keras.layers.Layer):
    """A sum over the examples added by a layer as Keras' own trainer_test.py
    writes one: its module is inside Keras' package, its class not Keras'."""

    __module__ = "keras.src.trainers.trainer_test"

    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs))
        return inputs


@pytest.mark.parametrize(
    "layer, probed",
    [
        (lambda: keras.layers.Dense(4), False),
        (lambda: keras.layers.Dense(4, activity_regularizer="l2"), True),
        (lambda: MeanPenalty(), True),  # not Keras' own: it may add_loss
        (lambda: InKerasTests(), True),
    ],
    ids=["keras", "activity", "own-layer", "keras-tests-layer"],
)
def test_the_probe_calls_a_model_only_where_a_term_may_be_added(
    monkeypatch, layer, probed
):
    called = []
    probe = loss_terms.probe
    monkeypatch.setattr(
        loss_terms, "probe", lambda *args: called.append(1) or probe(*args)
    )
    x, y = data()
    build = keras.Sequential([keras.Input((6,)), layer(), keras.layers.Dense(4)])
    build.compile(keras.optimizers.SGD(0.1), "mse")
    Towers(build, devices=devices(2)).fit(x, y, batch_size=EXAMPLES, verbose=0)
    assert bool(called) is probed


class OwnStep(keras.Model):
    """The fit guide's own train_step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class DeepNormalised(OwnStep):
    """Twenty Dense, BatchNormalization, ReLU6 blocks in float32 (a deep
    network's depth: MobileNetV2 has 52 such layers), with the fit guide's
    own train_step: the own step's probe runs it on two examples and each
    alone."""


def deep_normalised():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = inputs
    for _ in range(20):
        h = keras.layers.Dense(16, use_bias=False)(h)
        h = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization()(h))
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    model = DeepNormalised(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_deep_float32_networks_own_step_is_found_a_mean_and_trains_as_keras_fit():
    # Two examples' own moments amplify float32's rounding between a batch
    # of one and of two, block after block, past any tolerance: the probe
    # read such a loss as neither a mean nor a sum and refused it.
    x = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    y = np.arange(16) % 3
    engine, reference = Towers(deep_normalised(), devices=devices(2)), deep_normalised()
    before = reference.get_weights()
    got = engine.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    want = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    # Each variable's update by its norm: float32's rounding, not a loss
    # read as a sum (twice the step on 2 towers).
    for a, b, w, v in zip(
        engine.model.get_weights(), reference.get_weights(), before, reference.weights
    ):
        apart = np.linalg.norm((a - w) - (b - w)) / np.linalg.norm(b - w)
        assert apart < 1e-3, v.path


class PairMeans(keras.layers.Layer):
    """Each pair of rows (0 and 1, 2 and 3, ...) replaced by its mean: a
    forward pass that needs two rows, and couples only the rows of a pair."""

    def call(self, inputs):
        pairs = keras.ops.reshape(inputs, (-1, 2, inputs.shape[-1]))
        means = keras.ops.mean(pairs, axis=1, keepdims=True)
        return keras.ops.reshape(keras.ops.repeat(means, 2, axis=1), (-1, 8))


class TopTwoShift(keras.layers.Layer):
    """Its inputs less the mean of each feature's two largest values over the
    batch: ``top_k`` with k = 2 along the batch axis needs two rows."""

    def call(self, inputs):
        top, _ = keras.ops.top_k(keras.ops.transpose(inputs), k=2)
        return inputs - 0.0 * keras.ops.mean(top, axis=1)


def rows_needed(layer, own_step=False):
    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = layer()(keras.layers.Dense(8, activation="tanh")(inputs))
        model = (OwnStep if own_step else keras.Model)(
            inputs, keras.layers.Dense(4)(hidden)
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    return build


@pytest.mark.parametrize("own_step", [False, True], ids=["built_in", "own_step"])
@pytest.mark.parametrize("layer", [PairMeans, TopTwoShift])
def test_a_forward_pass_that_needs_more_rows_than_one_trains_as_keras_fit(
    layer, own_step
):
    # The probe's parts of one example fail in the model (a reshape into
    # pairs, top_k over fewer rows than k); it probes parts of a tower's
    # share instead, and the pairs, within a share, train as one device's.
    EXAMPLES_HERE = 8
    x, y = (a[:EXAMPLES_HERE] for a in data())
    build = rows_needed(layer, own_step)
    engine = Towers(build(), devices=devices(2))
    reference = build()
    before = reference.get_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed, so nothing left unsaid
        engine.fit(x, y, batch_size=EXAMPLES_HERE, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=EXAMPLES_HERE, shuffle=False, verbose=0)
    for got, want, variable in zip(
        updates(engine.model, before), updates(reference, before), reference.weights
    ):
        np.testing.assert_allclose(
            got,
            want,
            rtol=EQUIVALENCE_RTOL,
            atol=EQUIVALENCE_ATOL,
            err_msg=variable.path,
        )


def test_a_forward_pass_that_no_share_fits_is_named_not_a_raw_error():
    # Rows in pairs, 6 examples on 4 towers: shares of 2, 2, 1 and 1 rows.
    # Neither one example nor a share of one fits; towers' step on the
    # shares cannot run, and says so before any update.
    x, y = (a[:6] for a in data())
    engine = Towers(rows_needed(PairMeans, own_step=True)(), devices=devices(4))
    with pytest.warns(UserWarning, match="probe of how OwnStep's train_step"):
        with pytest.raises(ValueError, match="share") as raised:
            engine.fit(x, y, batch_size=6, shuffle=False, verbose=0)
    assert int(engine.optimizer.iterations) == 0
    assert "[2, 2, 1, 1] rows" in str(raised.value)


class RefusesTraining(keras.layers.Layer):
    """A layer whose call refuses to train, whatever rows it is given."""

    def call(self, inputs, training=False):
        if training:
            raise ValueError("this layer is for inference only")
        return inputs


def test_a_models_own_error_on_shares_that_fit_is_raised_as_it_is():
    # Every share fits the model by shapes: the error is the model's own,
    # not one of towers' shares, and reaches the user in its own words.
    x, y = (a[:6] for a in data())
    engine = Towers(rows_needed(RefusesTraining)(), devices=devices(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the probe cannot run it either
        with pytest.raises(ValueError, match="inference only") as raised:
            engine.fit(x, y, batch_size=6, shuffle=False, verbose=0)
    assert "share" not in str(raised.value)
    assert int(engine.optimizer.iterations) == 0

"""Rules of Keras' own fit, evaluate and predict that a model's author relies
on without writing them down, each against Keras' own call on one device
(issue 64, items 5-7): a ``call()`` without ``training``, a loss kept across
a compile without one, a model's own ``evaluate`` and ``predict``."""

import keras
import numpy as np

from tests.test_equivalence import devices
from tests.training.test_keras_fit_cases import assert_same_fit, twins
from towers import Towers


class NoTrainingArgument(keras.Model):
    """keras.io's GNN node classifier's shape: ``call()`` takes no
    ``training``, so Keras' fit calls it without one and its nested
    BatchNormalization runs in inference mode."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4)
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.norm(self.hidden(x)))


def regression(count=30, features=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, features)).astype("float32")
    return x, rng.standard_normal((count, 1)).astype("float32")


def test_a_call_without_training_runs_its_layers_as_keras_fit_does():
    x, y = regression()
    mine, model = twins(
        NoTrainingArgument, lambda: dict(optimizer="sgd", loss="mse"), x[:1]
    )
    assert_same_fit(Towers(mine, devices=devices(3)), model, x, y)
    # Inference mode all along: Keras never moves the statistics.
    np.testing.assert_array_equal(mine.norm.moving_mean.numpy(), np.zeros(4))


class AddsItsOwnLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(1e-2 * keras.ops.sum(x))
        return x


def with_activity_loss():
    inputs = keras.Input((3,))
    hidden = AddsItsOwnLoss()(keras.layers.Dense(4)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def test_a_compile_without_a_loss_keeps_the_loss_compiled_before():
    x, y = regression()
    mine, model = twins(with_activity_loss, lambda: dict(optimizer="sgd", loss="mse"))
    for each in (mine, model):  # the subclassing guide's second compile
        each.compile(optimizer=keras.optimizers.SGD(0.05))
    assert_same_fit(Towers(mine, devices=devices(3)), model, x, y)


class TakesWords(keras.Model):
    """keras.io's masked language model's shape: its own ``evaluate`` (and
    here ``predict``) turn words into ids before ``super()``'s."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 3)
        self.out = keras.layers.Dense(1)
        self.calls = []

    def call(self, ids):
        return self.out(keras.ops.mean(self.embed(ids), axis=1))

    def ids(self, sentences):
        return np.array([[len(w) for w in s.split()] for s in sentences], "int32")

    def evaluate(self, x=None, y=None, **kwargs):
        self.calls.append("evaluate")
        return super().evaluate(self.ids(x), y, **kwargs)

    def predict(self, x, **kwargs):
        self.calls.append("predict")
        return super().predict(self.ids(x), **kwargs)


def test_a_models_own_evaluate_and_predict_run_and_their_super_reaches_towers():
    sentences = ["a bb ccc", "dddd e ff", "g hh iii", "jjjj kk l"] * 3
    y = np.linspace(0, 1, len(sentences), dtype="float32")[:, None]
    mine, model = twins(
        TakesWords, lambda: dict(optimizer="sgd", loss="mse", metrics=["mae"]),
        np.zeros((1, 3), "int32"),
    )  # fmt: skip
    engine = Towers(mine, devices=devices(3))
    steps = []  # the towers' steps the overrides' super() calls reach
    for kind in ("evaluate_step", "predict_step"):
        own = getattr(engine, kind)
        setattr(
            engine, kind, lambda *a, own=own, kind=kind: steps.append(kind) or own(*a)
        )

    got = engine.evaluate(sentences, y, batch_size=5, verbose=0)
    want = model.evaluate(sentences, y, batch_size=5, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = engine.predict(sentences, batch_size=5, verbose=0)
    want = model.predict(sentences, batch_size=5, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert mine.calls == ["evaluate", "predict"]
    assert steps == ["evaluate_step"] * 3 + ["predict_step"] * 3


class ScalesItsInputs(keras.Model):
    """A model whose own ``fit`` changes its data before ``super().fit``."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(1)
        self.calls = 0

    def call(self, x):
        return self.out(x)

    def fit(self, x=None, y=None, **kwargs):
        self.calls += 1
        return super().fit(x * 2.0, y, **kwargs)


def test_a_models_own_fit_runs_and_trains_as_keras_fit():
    x, y = regression()
    mine, model = twins(
        ScalesItsInputs, lambda: dict(optimizer="sgd", loss="mse"), x[:1]
    )
    assert_same_fit(Towers(mine, devices=devices(3)), model, x, y)
    assert mine.calls == 1 and model.calls == 1

"""State a layer assigns in its forward pass: assigned once a step by the
variable's aggregation, never once per tower (towers/step/rules/state.py)."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers


class Counter(keras.layers.Layer):
    """Counts the training batches it saw (Keras' default aggregation,
    "none"), as Keras' BackupAndRestore tests count them."""

    def build(self, shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="count"
        )

    def call(self, x, training=False):
        if training:
            self.count.assign_add(1.0)
        return x


class Rules(keras.layers.Layer):
    """One variable per aggregation, each assigned in training."""

    def build(self, shape):
        def weight(name, aggregation):
            return self.add_weight(
                shape=(), initializer="zeros", trainable=False, name=name,
                aggregation=aggregation,
            )  # fmt: skip

        self.examples = weight("examples", "sum")
        self.level = weight("level", "mean")
        self.first = weight("first", "only_first_replica")
        self.steps = weight("steps", "none")

    def call(self, x, training=False):
        if training:
            self.examples.assign_add(ops.cast(ops.shape(x)[0], "float32"))
            self.level.assign(ops.mean(x))
            self.first.assign_add(ops.mean(x))
            self.steps.assign_add(1.0)
        return x


def model_with(layer, features=4):
    return keras.Sequential([keras.Input((features,)), layer, keras.layers.Dense(2)])


def test_a_counter_of_keras_default_aggregation_moves_once_a_step_as_in_fit():
    keras.utils.set_random_seed(0)
    mine, theirs = model_with(Counter()), model_with(Counter())
    theirs.set_weights(mine.get_weights())
    for model in (mine, theirs):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((30, 4)), rng.standard_normal((30, 2))
    engine = Towers(mine, devices=devices(3))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    theirs.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)

    assert float(mine.layers[0].count) == float(theirs.layers[0].count) == 8
    for got, want in zip(mine.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )
    # Every tower's value reads no example: one value, taken without a word.
    assert not [w for w in caught if "aggregation" in str(w.message)]


def test_each_aggregation_takes_the_towers_assignments_by_its_rule():
    model = model_with(Rules())
    engine = Towers(model, loss="mse", optimizer="sgd", devices=devices(3))
    x = np.arange(28, dtype="float32").reshape(7, 4)  # shards of 3, 2 and 2

    engine.train_step(x, np.zeros((7, 2), "float32"))

    rules = model.layers[0]
    shard_means = [x[:3].mean(), x[3:5].mean(), x[5:].mean()]
    assert float(rules.examples) == 7  # every tower's count, added
    # "mean" weighs each tower's by its examples: the whole batch's mean, as
    # one device assigns it (tf.distribute's mean of the shards' is 14.83).
    assert float(rules.level) == pytest.approx(x.mean())
    assert float(rules.level) != pytest.approx(np.mean(shard_means))
    assert float(rules.first) == pytest.approx(shard_means[0])
    assert float(rules.steps) == 1
    report = str(engine.explain(x, np.zeros((7, 2), "float32")))
    assert (
        f"{rules.examples.path}: aggregation 'sum': the towers' changes add up"
        in report
    )
    assert f"{rules.steps.path}: aggregation 'none': the towers' one value" in report


class InferenceCounter(Counter):
    def call(self, x, training=False):
        if not training:
            self.count.assign_add(1.0)
        return x


def test_evaluate_and_predict_assign_once_a_batch():
    model = model_with(InferenceCounter())
    engine = Towers(model, loss="mse", optimizer="sgd", devices=devices(4))
    x, y = np.ones((10, 4), "float32"), np.ones((10, 2), "float32")
    engine.evaluate(x, y, batch_size=4, verbose=0)  # 3 batches
    engine.predict(x, batch_size=5, verbose=0)  # 2 batches
    assert float(model.layers[0].count) == 5


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_statistics="global"),
        dict(batch_statistics="global", jit_compile=True),
        dict(jit_compile=True),
        dict(placement="replicated"),
    ],
    ids=["lockstep", "phases", "xla", "replicated"],
)
def test_every_path_of_a_step_assigns_once(options, xla_allowed):
    def build():
        return keras.Sequential(
            [
                keras.Input((4,)),
                Rules(),
                keras.layers.Dense(3),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(2),
            ]
        )

    if options.get("placement") == "replicated":
        build = lambda: model_with(Rules())  # noqa: E731  (no BatchNormalization)
    engine = Towers(build, loss="mse", optimizer="sgd", devices=devices(2), **options)
    x = np.arange(20, dtype="float32").reshape(5, 4)
    for _ in range(2):
        engine.train_step(x, np.zeros((5, 2), "float32"))
    for model in engine.placement.models:
        rules = model.layers[0]
        assert float(rules.steps) == 2
        if len(engine.placement.models) == 1:
            assert float(rules.examples) == 10
        else:  # each copy counts its own tower's shard
            assert float(rules.examples) in (6, 4)


class LastMean(keras.layers.Layer):
    """Keeps the last training batch's mean in a variable of Keras' default
    aggregation ("none"): each tower's value reads its own rows."""

    def build(self, shape):
        self.last = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="last"
        )

    def call(self, x, training=False):
        self.last.assign(ops.mean(x))
        return x


class LastDraw(LastMean):
    """Keeps a draw: one per tower, where one device draws once."""

    def build(self, shape):
        super().build(shape)
        self.seed = keras.random.SeedGenerator(1)

    def call(self, x, training=False):
        self.last.assign(keras.random.normal((), seed=self.seed))
        return x


class LastRows(LastMean):
    """Keeps the number of rows it saw: a shard's, a constant in its trace
    (each tower's own), where one device's is the batch's."""

    def call(self, x, training=False):
        self.last.assign(ops.cast(ops.shape(x)[0], "float32"))
        return x


@pytest.mark.parametrize(
    "layer, options",
    [
        (LastRows, {}),
        (LastRows, dict(batch_statistics="tower")),
        (LastMean, {}),
        (LastMean, dict(jit_compile=True)),
        (LastMean, dict(batch_statistics="global")),
        (LastDraw, {}),
    ],
    ids=["rows", "rows-once", "mean", "mean-xla", "mean-lockstep", "draw"],
)
def test_a_value_of_each_shard_under_aggregation_none_is_refused_by_name(
    layer, options, xla_allowed
):
    model = keras.Sequential(
        [keras.Input((4,)), layer(), keras.layers.Dense(3),
         keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    )  # fmt: skip
    engine = Towers(model, loss="mse", optimizer="sgd", devices=devices(3), **options)
    x, y = np.arange(28, dtype="float32").reshape(7, 4), np.ones((7, 2), "float32")
    before = [v.numpy() for v in model.variables]
    named = f"variable '{model.layers[0].last.path}' is assigned.*'none'"

    with pytest.raises(ValueError, match=named):
        engine.fit(x, y, batch_size=7, verbose=0)
    with pytest.raises(ValueError, match=named):
        engine.evaluate(x, y, batch_size=7, verbose=0)

    for b, v in zip(before, model.variables):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert int(model.optimizer.iterations) == 0

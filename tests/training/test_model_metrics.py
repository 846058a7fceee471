"""The model's own metrics through fit, evaluate and Keras' callbacks, against
Keras' own calls on one device (issue 39, items 1-4): custom metrics compiled
as objects and functions, registered for serialization or not; callbacks that
read a compiled metric's direction from ``model.metrics``; a metric the model
owns; a metric with a value per class."""

import keras
import numpy as np
import pytest
from keras import ops

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers


class SumOfPredictions(keras.metrics.Metric):
    """A streaming metric no registry knows: the sum of every prediction."""

    def __init__(self, name="predicted", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.sum(y_pred))

    def result(self):
        return self.total


@keras.saving.register_keras_serializable(package="towers_tests")
class LargestError(keras.metrics.Metric):
    """A registered one: the largest absolute error seen."""

    def __init__(self, name="largest_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable((), "zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = ops.max(ops.abs(ops.cast(y_true, y_pred.dtype) - y_pred))
        self.largest.assign(ops.maximum(self.largest, error))

    def result(self):
        return self.largest


def half_error(y_true, y_pred):
    """A metric function, registered nowhere."""
    return ops.mean(ops.abs(y_true - y_pred), axis=-1) / 2


def regression():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


def two_outputs():
    inputs = keras.Input((5,))
    return keras.Model(
        inputs,
        {
            "a": keras.layers.Dense(3, name="a")(inputs),
            "b": keras.layers.Dense(2, name="b")(inputs),
        },
    )


def compiled_pair(build, compile_args, num_towers=2):
    """A towers engine over one compiled model and Keras' model with the same
    weights, each compiled with its own objects (``compile_args()``)."""
    keras.utils.set_random_seed(0)
    mine, theirs = build(), build()
    theirs.set_weights(mine.get_weights())
    mine.compile(**compile_args())
    theirs.compile(**compile_args())
    return Towers(mine, devices=devices(num_towers)), theirs


def arrays(count=36, seed=1, outputs=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 5)).astype("float32")
    y = (x @ rng.standard_normal((5, 3))).astype("float32")
    if outputs == 2:
        return x, {"a": y, "b": y[:, :2] * 0.5}
    return x, y


def assert_close(got, want, name=""):
    np.testing.assert_allclose(
        got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL, err_msg=name
    )


def assert_same_history(got, want):
    assert sorted(got.history) == sorted(want.history)
    for name in want.history:
        assert_close(got.history[name], want.history[name], name)


@pytest.mark.parametrize("form", ["list", "per-output dict"])
def test_custom_metrics_are_the_compiled_models_own_objects(form):
    if form == "list":
        build, outputs = regression, 1

        def compile_args():
            metrics = [SumOfPredictions(), LargestError(), half_error, "mae"]
            return dict(
                optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=metrics
            )
    else:
        build, outputs = two_outputs, 2

        def compile_args():
            metrics = {
                "a": [keras.metrics.MeanSquaredError(), SumOfPredictions()],
                "b": [LargestError(), half_error],
            }
            return dict(
                optimizer=keras.optimizers.SGD(0.05),
                loss={"a": "mse", "b": "mae"},
                metrics=metrics,
            )

    engine, model = compiled_pair(build, compile_args)
    x, y = arrays(outputs=outputs)
    vx, vy = arrays(12, seed=2, outputs=outputs)
    options = dict(batch_size=10, epochs=2, verbose=0, shuffle=False)
    got = engine.fit(x, y, validation_data=(vx, vy), **options)
    want = model.fit(x, y, validation_data=(vx, vy), **options)

    assert_same_history(got, want)
    # The objects given to compile are the ones updated: no copy was rebuilt.
    given = engine.model._compile_config.config["metrics"]
    given = given if form == "list" else given["a"] + given["b"]
    flat = [m for m in given if isinstance(m, keras.metrics.Metric)]
    assert all(any(m is own for own in engine.model.metrics[1].metrics) for m in flat)
    assert engine.model.metrics_names == model.metrics_names
    for name, value in model.get_metrics_result().items():
        assert_close(engine.model.get_metrics_result()[name], value)
    assert engine.evaluate(vx, vy, verbose=0) == pytest.approx(
        model.evaluate(vx, vy, verbose=0), rel=EQUIVALENCE_RTOL
    )


@pytest.mark.parametrize(
    "callback",
    [
        lambda path: keras.callbacks.EarlyStopping(monitor="val_mse", patience=0),
        lambda path: keras.callbacks.ReduceLROnPlateau(
            monitor="val_mse", factor=0.5, patience=0, min_delta=10.0
        ),
        lambda path: keras.callbacks.ModelCheckpoint(
            str(path), monitor="val_accuracy", save_best_only=True
        ),
    ],
    ids=["EarlyStopping", "ReduceLROnPlateau", "ModelCheckpoint"],
)
def test_callbacks_read_a_compiled_metrics_direction_as_on_keras(callback, tmp_path):
    def compile_args():
        return dict(
            optimizer=keras.optimizers.SGD(0.05),
            loss="mse",
            metrics=["mse", "accuracy"],
        )

    engine, model = compiled_pair(regression, compile_args)
    x, y = arrays()
    vx, vy = arrays(12, seed=2)
    runs = []
    for runner, name in ((engine, "towers"), (model, "keras")):
        watcher = callback(tmp_path / f"{name}.weights.h5")
        history = runner.fit(
            x, y, batch_size=10, epochs=4, validation_data=(vx, vy), verbose=0,
            shuffle=False, callbacks=[watcher],
        )  # fmt: skip
        lr = float(runner.optimizer.learning_rate)
        runs.append((history.epoch, lr, getattr(watcher, "best", None)))
    (epochs, lr, best), (keras_epochs, keras_lr, keras_best) = runs
    assert epochs == keras_epochs
    assert lr == pytest.approx(keras_lr)
    assert best == pytest.approx(keras_best, rel=EQUIVALENCE_RTOL)


class OwnMetrics(keras.Model):
    """A model with metrics of its own: one updated in ``call`` with each
    example's value, one in ``compute_loss`` with the batch's loss (Keras'
    documented pattern)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.activity = keras.metrics.Mean(name="activity")
        self.four_losses = keras.metrics.Mean(name="four_losses")

    def call(self, x):
        out = self.dense(x)
        self.activity.update_state(ops.sum(ops.abs(out), axis=-1))
        return out

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.four_losses.update_state(loss * 4)
        return loss


def test_a_metric_the_model_owns_is_in_the_logs_history_and_evaluate():
    def build():
        model = OwnMetrics()
        model(np.zeros((1, 5), "float32"))
        return model

    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    engine, model = compiled_pair(build, compile_args)
    x, y = arrays(40)
    # Batches of 10 on 2 towers: each tower's loss is a mean over 5 of the
    # 10, so the mean of the towers' values is the batch's (compute_loss's
    # tracker takes one value per tower: see docs/keras.md).
    options = dict(batch_size=10, epochs=2, verbose=0, shuffle=False)
    got, want = engine.fit(x, y, **options), model.fit(x, y, **options)

    assert_same_history(got, want)
    assert {"activity", "four_losses"} <= set(got.history)
    returned = engine.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    expected = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert sorted(returned) == sorted(expected)
    for name in expected:
        assert_close(returned[name], expected[name])


def test_a_metric_with_a_value_per_class_is_kept_in_the_logs():
    def classifier():
        return keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(3, activation="sigmoid")]
        )

    def compile_args():
        return dict(
            optimizer=keras.optimizers.SGD(0.1),
            loss="binary_crossentropy",
            metrics=[keras.metrics.F1Score(threshold=0.5), keras.metrics.FBetaScore()],
        )

    engine, model = compiled_pair(classifier, compile_args)
    x, _ = arrays()
    y = (x[:, :3] > 0).astype("float32")
    options = dict(batch_size=10, epochs=2, verbose=0, shuffle=False)
    got, want = engine.fit(x, y, **options), model.fit(x, y, **options)

    assert_same_history(got, want)
    assert np.shape(got.history["f1_score"][0]) == (3,)
    returned = engine.evaluate(x, y, verbose=0)
    expected = model.evaluate(x, y, verbose=0)
    assert len(returned) == len(expected) == 3
    for mine, theirs in zip(returned, expected):
        assert_close(mine, theirs)


class HoldsAMetric(keras.Model):
    """A metric held as an attribute, never updated: Keras' fit still lists it
    in ``model.metrics`` after the loss tracker and the compiled metrics."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, use_bias=False)
        self.held = keras.metrics.MeanSquaredError(name="held")

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("weighted", [False, True], ids=["metrics", "weighted"])
def test_a_metric_the_model_holds_is_tracked_as_keras_fit_tracks_it(weighted):
    def metrics_after_fit(fit_of):
        model = HoldsAMetric()
        given = [keras.metrics.MeanSquaredError()]
        model.compile(
            "sgd", "mse", **{"weighted_metrics" if weighted else "metrics": given}
        )
        x, y = np.ones((4, 4), "float32"), np.zeros((4, 3), "float32")
        fit_of(model)(x, y, batch_size=4, verbose=0, sample_weight=np.ones(4))
        return [
            (type(m).__name__, m.name, len(m.variables)) for m in model.metrics
        ], len(model.metrics_variables)

    got = metrics_after_fit(lambda model: Towers(model, devices=devices(2)).fit)
    want = metrics_after_fit(lambda model: model.fit)
    assert got == want
    assert want == (
        [("Mean", "loss", 2), ("CompileMetrics", "compile_metrics", 2),
         ("MeanSquaredError", "held", 2)],
        6,
    )  # fmt: skip

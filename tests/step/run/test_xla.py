"""jit_compile: each tower's forward and backward pass as one XLA computation on
its device, exact against Keras' own XLA fit on one device (to float32
rounding), and chosen by Keras' rules.

The suite turns op determinism on (conftest.py), and Keras then refuses XLA
(``model_supports_jit``): the tests that compare with Keras' XLA fit turn it
off while they run (the ``xla_allowed`` fixture, tests/conftest.py), or Keras'
side would silently run without XLA (each test asserts its ``jit_compile``).
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import step_graph
from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.devices import canonical_device
from towers.explain.graph import xla_calls
from towers.step.run import xla

EXAMPLES = 37  # batches of 10, 10, 10 and 7: uneven over 2 and 4 towers
BATCH = 10


def classifier():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer="l2"),
            keras.layers.Dense(3),
        ]
    )


def convolutional():
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def compiled(build, jit_compile, loss=None):
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01, epsilon=1e-3),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"] if loss is None else ["mae"],
        jit_compile=jit_compile,
    )
    return model


def data(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, *shape)).astype("float32")
    y = rng.integers(0, 3, EXAMPLES)
    return x, y, rng.uniform(0.2, 2.0, EXAMPLES).astype("float32")


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def assert_same_updates(model, reference, before):
    """Each variable's change (after - before) equals Keras' change."""
    for got, want, start in zip(model.weights, reference.weights, before):
        assert_close(got.numpy() - start, want.numpy() - start)


def fit(trainer, x, y, sample_weight):
    """Keras' fit or the engine's, with the same call: 2 epochs of 10-example
    batches in order."""
    return trainer.fit(
        x, y, sample_weight=sample_weight, batch_size=BATCH, epochs=2,
        shuffle=False, verbose=0,
    )  # fmt: skip


def keras_xla_fit(build, x, y, sample_weight, loss=None):
    model = compiled(build, True, loss)
    assert model.jit_compile is True  # Keras' fit really compiles with XLA
    before = [w.numpy() for w in model.weights]
    return model, before, fit(model, x, y, sample_weight).history


@pytest.mark.parametrize("num_towers", [1, 2, 4])
@pytest.mark.parametrize(
    "build, shape", [(classifier, (8,)), (convolutional, (8, 8, 2))]
)
def test_fit_evaluate_and_predict_match_keras_xla_fit_on_one_device(
    xla_allowed, build, shape, num_towers
):
    x, y, sample_weight = data(shape)
    reference, before, want = keras_xla_fit(build, x, y, sample_weight)
    model = compiled(build, True)
    engine = Towers(model, devices=devices(num_towers))  # the model's jit_compile
    assert engine.step.builtin.jit.enabled
    got = fit(engine, x, y, sample_weight)
    assert_same_updates(model, reference, before)
    assert_close(got["loss"], want["loss"])
    assert_close(
        got["sparse_categorical_accuracy"], want["sparse_categorical_accuracy"]
    )
    results = engine.evaluate(
        x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0
    )
    wanted = reference.evaluate(
        x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0
    )
    assert_close(results, wanted)  # [loss, accuracy], as Keras returns them
    assert_close(
        engine.predict(x, batch_size=BATCH),
        reference.predict(x, batch_size=BATCH, verbose=0),
    )


@pytest.mark.parametrize("num_towers", [2, 4])
def test_each_tower_is_one_xla_call_on_its_own_device(num_towers):
    x, y, sample_weight = data((8,))
    engine = Towers(compiled(classifier, False), devices=devices(num_towers),
                    jit_compile=True)  # fmt: skip
    graph = step_graph(engine, x[:BATCH], y[:BATCH], sample_weight[:BATCH])
    calls = xla_calls(graph)
    assert [c.stage for c in calls] == [f"tower {t} XLA" for t in range(num_towers)]
    assert [c.device for c in calls] == [canonical_device(d) for d in engine.devices]
    assert all(c.ops > 20 for c in calls)  # the whole pass: forward and backward
    without = step_graph(
        Towers(compiled(classifier, False), devices=devices(num_towers)),
        x[:BATCH], y[:BATCH], sample_weight[:BATCH],
    )  # fmt: skip
    assert xla_calls(without) == []


def test_a_divisor_from_sample_weights_is_a_sum_between_two_computations(
    xla_allowed,
):
    """Keras' "mean_with_sample_weight" divides by the batch's sum of weights:
    every tower's forward pass is one computation, the towers' sum of their
    divisors follows, then each tower's backward pass is another."""
    x, y, sample_weight = data((8,))
    targets = np.eye(3, dtype="float32")[y]
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    reference, before, want = keras_xla_fit(classifier, x, targets, sample_weight, loss)
    model = compiled(classifier, True, loss)
    engine = Towers(model, devices=devices(2))
    got = fit(engine, x, targets, sample_weight)
    assert_same_updates(model, reference, before)
    assert_close(got["loss"], want["loss"])
    assert_close(got["mae"], want["mae"])
    graph = step_graph(engine, x[:BATCH], targets[:BATCH], sample_weight[:BATCH])
    functions = [
        re.sub(r"^__inference_|_\d+$", "", c.function) for c in xla_calls(graph)
    ]
    assert [c.stage for c in xla_calls(graph)] == ["tower 0 XLA", "tower 1 XLA"] * 2
    assert functions == ["tower_phase_0"] * 2 + ["tower_phase_1"] * 2


def test_a_copy_per_tower_compiles_each_copy_and_stays_exact(xla_allowed):
    x, y, sample_weight = data((8,))
    reference, before, want = keras_xla_fit(classifier, x, y, sample_weight)
    engine = Towers(
        classifier,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(0.01, epsilon=1e-3),
        devices=devices(2),
        placement="replicated",
        jit_compile=True,
    )
    engine.model.set_weights(before)
    engine.after_restore()
    fit(engine, x, y, sample_weight)
    for copy in engine.placement.models:
        assert_same_updates(copy, reference, before)


def test_the_argument_wins_over_the_compiled_models_choice():
    on = Towers(compiled(classifier, False), devices=devices(2), jit_compile=True)
    off = Towers(compiled(classifier, True), devices=devices(2), jit_compile=False)
    assert on.step.builtin.jit == xla.Jit(enabled=True, strict=True)
    assert off.step.builtin.jit == xla.OFF


def test_auto_decides_as_keras_does():
    model = classifier()
    # Keras' "auto": no XLA on a CPU; here Keras' compile agrees.
    assert xla.resolve("auto", model, ["/cpu:0", "/cpu:1"]) == xla.OFF
    assert compiled(classifier, "auto").jit_compile is False
    assert Towers(
        compiled(classifier, "auto"), devices=devices(2)
    ).step.builtin.jit == (xla.OFF)
    # Op determinism (on in this suite) turns "auto" off, as in Keras.
    assert xla.resolve("auto", model, ["/gpu:0", "/gpu:1"]) == xla.OFF


def test_auto_compiles_on_accelerators_unless_a_layer_refuses(xla_allowed):
    model = classifier()
    assert xla.resolve("auto", model, ["/gpu:0", "/gpu:1"]) == xla.Jit(True, False)
    model.layers[1].supports_jit = False  # as Keras' string layers say
    with pytest.warns(UserWarning, match=model.layers[1].name):
        assert xla.resolve("auto", model, ["/gpu:0", "/gpu:1"]) == xla.OFF
    with pytest.raises(ValueError, match=f"supports_jit=False.*{model.layers[1].name}"):
        xla.resolve(True, model, ["/gpu:0"])


@pytest.mark.parametrize("value", ["yes", 1, "on"])
def test_an_unknown_jit_compile_is_refused_by_value(value):
    with pytest.raises(ValueError, match=f"True, False or 'auto'; received {value!r}"):
        Towers(compiled(classifier, False), devices=devices(2), jit_compile=value)


class ViaText(keras.layers.Layer):
    """A layer with string ops, which XLA cannot compile."""

    def call(self, x):
        return tf.strings.to_number(tf.strings.as_string(x))


def textual():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2),
            ViaText(name="via_text"),
            keras.layers.Dense(1),
        ]
    )


def text_engine(jit_compile):
    keras.utils.set_random_seed(2)
    return Towers(
        textual, "mse", keras.optimizers.SGD(0.1), devices(2), jit_compile=jit_compile
    )


def test_true_fails_naming_the_layer_xla_cannot_compile_and_changes_nothing():
    engine = text_engine(True)
    before = [w.numpy() for w in engine.model.weights]
    x, y = np.ones((5, 3), "float32"), np.zeros((5, 1), "float32")
    with pytest.raises(ValueError, match=r"cannot compile layers \['via_text'\]"):
        engine.train_step(x, y)
    assert int(engine.optimizer.iterations.numpy()) == 0
    assert engine.steps_done == 0
    for weight, start in zip(engine.model.weights, before):
        np.testing.assert_array_equal(weight.numpy(), start)


def test_auto_falls_back_without_xla_naming_the_layer():
    """On an accelerator "auto" chooses XLA (the test above); an op it cannot
    compile then warns, and the step runs as it does without XLA."""
    engine, plain = text_engine(False), text_engine(False)
    engine.step.builtin.jit = xla.Jit(enabled=True, strict=False)  # "auto" on a GPU
    x = np.random.default_rng(3).standard_normal((5, 3)).astype("float32")
    y = np.zeros((5, 1), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs = engine.train_step(x, y)
    assert any("via_text" in str(w.message) for w in caught), caught
    assert engine.step.builtin.jit == xla.OFF
    want = plain.train_step(x, y)
    assert_close(float(logs["loss"]), float(want["loss"]))
    for got, wanted in zip(engine.model.weights, plain.model.weights):
        assert_close(got.numpy(), wanted.numpy())

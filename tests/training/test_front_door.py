"""Wrong calls of fit, evaluate and predict, as a new user makes them: each
gets one clear error, before any update, that names the argument, what was
received and what was expected; the weights, the optimizer's slots and
iterations and any checkpoint directory are as they were (issue 41)."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from towers import Towers

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 10)).astype("float32")
Y = RNG.integers(0, 3, 16)


def classifier():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3)])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def dataset(x, y, batch=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


class Batches(keras.utils.PyDataset):
    """X and Y in two batches of 8."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return X[8 * index : 8 * index + 8], Y[8 * index : 8 * index + 8]


def state(engine):
    """Weights, optimizer variables (slots, iterations) once built."""
    optimizer = [v.numpy().copy() for v in engine.model.optimizer.variables]
    return [w.copy() for w in engine.model.get_weights()], optimizer


def assert_unchanged(engine, before):
    weights, optimizer = state(engine)
    for got, want in zip(weights, before[0], strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(optimizer, before[1]):
        np.testing.assert_array_equal(got, want)
    assert int(engine.model.optimizer.iterations) == 0


CASES = {
    # Issue 41's cases, item by item.
    "validation features (item 1)": (
        lambda e: e.fit(X, Y, batch_size=8, validation_data=(X[:, :7], Y)),
        r"validation_data's x does not fit the model: received float32 \(16, 7\);"
        r" the model takes float32 \(None, 10\)\. Keras: .*value 10",
    ),
    "validation dataset features (item 1)": (
        lambda e: e.fit(X, Y, batch_size=8, validation_data=dataset(X[:, :7], Y)),
        r"validation_data's x does not fit the model: received float32 \(None, 7\)",
    ),
    "validation features beside a PyDataset (item 1)": (
        lambda e: e.fit(Batches(), validation_data=(X[:, :7], Y)),
        r"validation_data's x does not fit the model: received float32 \(16, 7\)",
    ),
    "validation targets (item 1)": (
        lambda e: e.fit(X, Y, batch_size=8, validation_data=(X, np.zeros((16, 4)))),
        r"validation_data's y does not fit the model's outputs and loss: received "
        r"float64 \(16, 4\); the model outputs float32 \(None, 3\)",
    ),
    "string labels (item 6)": (
        lambda e: e.fit(X, np.array(["a", "b", "c", "a"] * 4)),
        r"y holds strings: received y str32 \(16,\); Keras' fit takes arrays of "
        r"numbers",
    ),
    "validation_data of 4 (item 6)": (
        lambda e: e.fit(X, Y, validation_data=(X, Y, np.ones(16), np.ones(16))),
        r"validation_data must be \(x, y\) or \(x, y, sample_weight\) .*received "
        r"a tuple of 4: \[0\] float32 \(16, 10\), \[1\] int64 \(16,\)",
    ),
    "class_weight missing a class, tf.data (item 6)": (
        lambda e: e.fit(dataset(X, Y), class_weight={0: 1.0, 1: 2.0}),
        r"class_weight has no weight for a label in batch 1 of the pass: it "
        r"weighs classes \[0, 1\].*indices\[\d+\] = 2 is not in \[0, 2\)",
    ),
    "class_weight a list": (
        lambda e: e.fit(X, Y, class_weight=[1.0, 2.0]),
        r"class_weight must be a dict \{class index: weight\}; received a list",
    ),
    "features in fit (item 7)": (
        lambda e: e.fit(X[:, :7], Y, batch_size=16),
        r"^x does not fit the model: received float32 \(16, 7\); the model takes "
        r"float32 \(None, 10\)",
    ),
    "features in evaluate (item 7)": (
        lambda e: e.evaluate(X[:, :7], Y),
        r"^x does not fit the model: received float32 \(16, 7\)",
    ),
    "features in predict (item 7)": (
        lambda e: e.predict(X[:, :7], batch_size=16),
        r"^x does not fit the model: received float32 \(16, 7\)",
    ),
    "features in train_step (item 7)": (
        lambda e: e.train_step(X[:, :7], Y),
        r"^x does not fit the model: received float32 \(16, 7\)",
    ),
    "target shape (item 7)": (
        lambda e: e.fit(X, np.zeros((16, 4)), batch_size=16),
        r"^y does not fit the model's outputs and loss: received float64 \(16, 4\)",
    ),
    "rank in fit (item 7)": (
        lambda e: e.fit(RNG.standard_normal((16, 32, 32)), Y),
        r"^x does not fit the model: received float64 \(16, 32, 32\)",
    ),
    "rank in predict (item 7)": (
        lambda e: e.predict(RNG.standard_normal((16, 32, 32)).astype("float32")),
        r"^x does not fit the model: received float32 \(16, 32, 32\)",
    ),
    "a dict for one input": (
        lambda e: e.predict({"a": X}),
        r"^x does not fit the model: received \['a'\] float32 \(16, 10\); the "
        r"model takes float32 \(None, 10\)",
    ),
    "empty arrays (item 8)": (
        lambda e: e.fit(np.zeros((0, 10), "float32"), np.zeros(0, "int64")),
        r"x holds no examples: received x float32 \(0, 10\)",
    ),
    "empty arrays in predict (item 8)": (
        lambda e: e.predict(np.zeros((0, 10), "float32")),
        r"x holds no examples: received x float32 \(0, 10\)",
    ),
    "empty dataset (item 8)": (
        lambda e: e.fit(dataset(X[:0], Y[:0])),
        r"x holds no examples: received a dataset of 0 batches",
    ),
    "dataset filtered to nothing (item 8)": (
        lambda e: e.fit(dataset(X, Y).unbatch().filter(lambda a, b: False).batch(8)),
        r"x holds no examples: received input that yields no batch",
    ),
    "callbacks": (
        lambda e: e.fit(X, Y, callbacks=[1]),
        r"callbacks must be keras.callbacks.Callback objects; received 1 \(a int\)",
    ),
    "callbacks in evaluate": (
        lambda e: e.evaluate(X, Y, callbacks=["x"]),
        r"callbacks must be keras.callbacks.Callback objects; received 'x'",
    ),
    # What kept working, kept: each names the argument and what it expected.
    "cardinality": (
        lambda e: e.fit(X, Y[:15]),
        r"Data cardinality is ambiguous.*'x' sizes: 16\s+'y' sizes: 15",
    ),
    "sample_weight length": (
        lambda e: e.fit(X, Y, sample_weight=np.ones(10)),
        r"'sample_weight' sizes: 10",
    ),
    "sample_weight without y": (
        lambda e: e.fit(X, sample_weight=np.ones(16)),
        r"sample_weight weighs targets; received it with y=None",
    ),
    "no targets": (
        lambda e: e.fit(X),
        r"loss sparse_categorical_crossentropy compares predictions with targets; "
        r"received a batch without targets \(y=None\)",
    ),
    # TensorFlow's error, as in Keras' own fit: whichever op of the loss or its
    # gradient meets the label first (the loss, a gather or a segment sum).
    "label range": (
        lambda e: e.fit(X, Y + 5, batch_size=8),
        r"Received a label value of \d+ which is outside the valid range of "
        r"\[0, 3\)|segment_ids\[\d+\] = \d+ is out of range|"
        r"indices\[\d+\] = \d+ is not in \[0, \d+\)",
    ),
    "batch_size 0": (
        lambda e: e.fit(X, Y, batch_size=0),
        r"batch_size must be a positive integer; received batch_size=0",
    ),
    "batch_size a string": (
        lambda e: e.evaluate(X, Y, batch_size="8"),
        r"batch_size must be a positive integer; received batch_size='8'",
    ),
    "steps 0": (
        lambda e: e.evaluate(X, Y, steps=0),
        r"steps must be a positive integer; received 0",
    ),
    "steps_per_epoch -1": (
        lambda e: e.fit(X, Y, steps_per_epoch=-1),
        r"steps_per_epoch must be a positive integer; received -1",
    ),
    "verbose 5": (
        lambda e: e.fit(X, Y, verbose=5),
        r"verbose must be 0, 1, 2 or 'auto'; received 5",
    ),
    "epochs -1": (
        lambda e: e.fit(X, Y, epochs=-1),
        r"epochs must be an integer >= 0; received -1",
    ),
    "epochs 2.5": (
        lambda e: e.fit(X, Y, epochs=2.5),
        r"epochs must be an integer >= 0; received 2.5",
    ),
    "validation_split 1.5": (
        lambda e: e.fit(X, Y, validation_split=1.5),
        r"validation_split must be in \[0, 1\); received 1.5",
    ),
    "validation_freq 0": (
        lambda e: e.fit(X, Y, validation_split=0.25, validation_freq=0),
        r"validation_freq must be a positive integer; received 0",
    ),
    "initial_epoch a string": (
        lambda e: e.fit(X, Y, initial_epoch="1"),
        r"initial_epoch must be an integer >= 0; received '1'",
    ),
    "shuffle a string": (
        lambda e: e.fit(X, Y, shuffle="yes"),
        r"shuffle must be True, False or a seed \(an integer >= 0\); received 'yes'",
    ),
    "x None": (
        lambda e: e.fit(None, Y),
        r"x must be the inputs .*; received None",
    ),
    "checkpoint_dir a file": (
        lambda e: e.fit(X, Y, checkpoint_dir=__file__),
        r"checkpoint_dir must be a directory; received '.*', which is a file",
    ),
}


@pytest.mark.parametrize("call, message", CASES.values(), ids=CASES.keys())
def test_a_wrong_call_is_named_before_any_update(call, message):
    engine = Towers(classifier(), devices=devices(2))
    before = state(engine)
    # A label out of range is found as the step runs (TensorFlow's error).
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as caught:
        call(engine)
    text = str(caught.value)
    assert re.search(message, text, re.DOTALL), text
    if isinstance(caught.value, ValueError):
        assert len(text) < 700, text  # shapes and dtypes, never the data
    assert_unchanged(engine, before)


def test_a_wrong_call_leaves_a_checkpoint_directory_as_it_was(tmp_path):
    engine = Towers(classifier(), devices=devices(2))
    directory = tmp_path / "run"
    engine.fit(X, Y, batch_size=8, checkpoint_dir=str(directory), verbose=0)
    files = {p: os.path.getmtime(directory / p) for p in os.listdir(directory)}
    before = state(engine)
    for wrong in (
        dict(validation_data=(X[:, :7], Y)),
        dict(class_weight=[1.0]),
        dict(callbacks=[1]),
        dict(epochs=2.5),
    ):
        with pytest.raises(ValueError):
            engine.fit(X, Y, checkpoint_dir=str(directory), verbose=0, **wrong)
    now = {p: os.path.getmtime(directory / p) for p in os.listdir(directory)}
    assert now == files
    weights, optimizer = state(engine)
    for got, want in zip(weights + optimizer, before[0] + before[1], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_class_weight_missing_a_later_batchs_label_trains_only_before_it():
    # The labels of a dataset are read as it runs: batch 1 (labels 0 and 1)
    # trains, batch 2 (label 2) is refused naming class_weight, and nothing
    # of it is applied.
    engine = Towers(classifier(), devices=devices(2))
    labels = np.array([0, 1] * 4 + [2] * 8)
    with pytest.raises(ValueError, match=r"label in batch 2 of the pass"):
        engine.fit(dataset(X, labels), class_weight={0: 1.0, 1: 2.0}, verbose=0)
    assert int(engine.model.optimizer.iterations) == 1


def two_towers(**options):
    return lambda model: Towers(model, devices=devices(2), **options)


CONSTRUCTORS = {
    "a device that does not exist": (
        lambda m: Towers(m, devices=["/gpu:9"]),
        r"devices must exist; received '/gpu:9', available: \['/device:CPU:0'",
    ),
    "no devices": (
        lambda m: Towers(m, devices=[]),
        r"devices must name at least one device; received devices=\[\]",
    ),
    "a device twice": (
        lambda m: Towers(m, devices=["/cpu:0", "/cpu:0"]),
        r"devices must not repeat; received '/cpu:0' and '/cpu:0'",
    ),
    "a layer as the model (item 3)": (
        lambda m: Towers(keras.layers.Dense(3), "mse", "sgd", devices=devices(2)),
        r"model must be a keras.Model, or a zero-argument function that builds "
        r"one; received a Dense layer",
    ),
    "a function of inputs as the model (item 3)": (
        lambda m: Towers(lambda inputs: inputs, "mse", "sgd", devices=devices(2)),
        r"received a function that takes arguments",
    ),
    "an unknown placement": (
        two_towers(placement="everywhere"),
        r"unknown placement; received 'everywhere', expected one of \['central'",
    ),
    "an unknown reducer": (
        two_towers(reducer="fast"),
        r"unknown reducer; received 'fast', expected a reducer object or one of",
    ),
    "an unknown non-finite policy": (
        two_towers(on_nonfinite="maybe"),
        r"on_nonfinite must be one of \['ignore', 'raise', 'skip'\]; received 'maybe'",
    ),
    "accumulate_steps 0": (
        two_towers(accumulate_steps=0),
        r"accumulate_steps must be a positive integer; received 0",
    ),
    "an unknown variable_device (item 5)": (
        two_towers(variable_device="/cpu:99"),
        r"variable_device must exist; received '/cpu:99'",
    ),
}


@pytest.mark.parametrize("make, message", CONSTRUCTORS.values(), ids=CONSTRUCTORS)
def test_a_wrong_engine_is_named_before_anything_is_built(make, message):
    model = classifier()
    before = model.get_weights()
    with pytest.raises(ValueError, match=message):
        make(model)
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_model_without_loss_or_optimizer_asks_for_them_when_fit():
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3)])
    engine = Towers(model, devices=devices(2))
    with pytest.raises(ValueError, match=r"Towers.fit needs a loss and an optimizer"):
        engine.fit(X, Y, verbose=0)


def test_a_generator_failing_mid_epoch_leaves_the_steps_before_it_and_no_more(
    tmp_path,
):
    def batches():
        for start in (0, 8):
            yield X[start : start + 4], Y[start : start + 4]
        raise OSError("the disk went away")

    engine = Towers(classifier(), devices=devices(2))
    # Read through tf.data, as Keras' fit reads a generator: its error comes
    # wrapped (as in Keras' own fit), its text kept.
    with pytest.raises(tf.errors.UnknownError, match="the disk went away"):
        engine.fit(batches(), epochs=1, verbose=0, checkpoint_dir=str(tmp_path))
    assert int(engine.model.optimizer.iterations) == 2
    assert engine.steps_done == 2
    assert not list(tmp_path.rglob("*.index"))  # no checkpoint of a torn epoch


def test_a_non_finite_gradient_with_raise_changes_nothing():
    engine = Towers(classifier(), devices=devices(2), on_nonfinite="raise")
    before = state(engine)
    x = X.copy()
    x[3, 2] = np.nan
    with pytest.raises(FloatingPointError, match=r"not finite"):
        engine.fit(x, Y, batch_size=16, verbose=0)
    weights, optimizer = state(engine)
    for got, want in zip(weights, before[0], strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(engine.model.optimizer.iterations) == 0

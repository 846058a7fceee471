"""Keras' fit, evaluate and predict arguments and defaults, each against what
Keras' own call does with the same arguments on one device (Keras shuffles
arrays by default: its side gets shuffle=False where the order must match)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.training.inputs import source_of

EXAMPLES = 70  # 32 + 32 + 6 in Keras' default batches


def regression():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


def pair(num_towers=3):
    """A towers engine and Keras' model with the same weights, both compiled
    with SGD and MSE."""
    keras.utils.set_random_seed(0)
    engine = Towers(regression, "mse", keras.optimizers.SGD(0.05), devices(num_towers))
    model = regression()
    model.set_weights(engine.model.get_weights())
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return engine, model


def arrays(examples=EXAMPLES, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, 5)).astype("float32")
    return x, (x @ rng.standard_normal((5, 3))).astype("float32")


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL)


def assert_same_weights(engine, model):
    for got, want in zip(engine.model.get_weights(), model.get_weights()):
        assert_close(got, want)


def test_no_batch_size_means_keras_32_in_fit_evaluate_and_predict():
    engine, model = pair()
    x, y = arrays()
    engine.fit(x, y, verbose=0, shuffle=False)
    model.fit(x, y, verbose=0, shuffle=False)
    assert engine.steps_done == 3  # 32 + 32 + 6
    assert_same_weights(engine, model)
    assert_close(engine.evaluate(x, y), model.evaluate(x, y, verbose=0))
    assert_close(engine.predict(x), model.predict(x, verbose=0))


def test_validation_split_holds_out_the_last_examples_as_keras_does():
    engine, model = pair()
    x, y = arrays()
    options = dict(
        batch_size=16, epochs=2, validation_split=0.25, verbose=0, shuffle=False
    )
    got = engine.fit(x, y, **options).history
    want = model.fit(x, y, **options).history
    assert sorted(got) == sorted(want) == ["loss", "val_loss"]
    for name in want:
        assert_close(got[name], want[name])
    assert engine.steps_done == 2 * 4  # 52 of the 70 train, in batches of 16
    assert_same_weights(engine, model)


def test_validation_freq_steps_and_batch_size_are_keras():
    engine, model = pair()
    x, y = arrays()
    vx, vy = arrays(30, seed=2)
    options = dict(
        batch_size=16,
        epochs=4,
        validation_data=(vx, vy),
        validation_freq=2,
        validation_steps=2,  # 2 batches of 7: 14 of the 30 examples
        validation_batch_size=7,
        verbose=0,
        shuffle=False,
    )
    got = engine.fit(x, y, **options).history
    want = model.fit(x, y, **options).history
    assert len(got["val_loss"]) == len(want["val_loss"]) == 2  # epochs 2 and 4
    assert_close(got["val_loss"], want["val_loss"])
    assert_close(got["loss"], want["loss"])
    listed = engine.fit(x, y, **{**options, "validation_freq": [1, 3]}).history
    assert len(listed["val_loss"]) == 2


def test_initial_epoch_starts_the_count_there():
    engine, model = pair()
    x, y = arrays()
    seen = []
    count = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: seen.append(e)
    )
    got = engine.fit(
        x, y, epochs=3, initial_epoch=1, verbose=0, callbacks=[count], shuffle=False
    )
    want = model.fit(x, y, epochs=3, initial_epoch=1, verbose=0, shuffle=False)
    assert got.epoch == want.epoch == seen == [1, 2]
    assert_close(got["loss"], want.history["loss"])
    assert_same_weights(engine, model)


def test_verbose_2_prints_one_line_per_epoch(capsys):
    engine, _ = pair()
    x, y = arrays()
    engine.fit(x, y, epochs=2, validation_split=0.2, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" - ")[0] for line in lines] == [
        "Epoch 1/2",
        "2/2",
        "Epoch 2/2",
        "2/2",
    ]
    assert all("loss: " in line and "val_loss: " in line for line in lines[1::2])
    assert "\r" not in "".join(lines)  # no progress bar


@pytest.mark.parametrize(
    "options, message",
    [
        ({"verbose": 3}, r"verbose must be 0, 1, 2 or 'auto'; received 3"),
        (
            {"validation_split": 1.0},
            r"validation_split must be in \[0, 1\); received 1",
        ),
        ({"initial_epoch": -1}, r"initial_epoch must be an integer >= 0; received -1"),
        ({"validation_freq": 0}, r"validation_freq must be a positive integer"),
        ({"validation_steps": 0}, r"validation_steps must be a positive integer"),
        ({"shuffle": "batch"}, r"shuffle must be True, False or a seed .* 'batch'"),
        ({"epochs": 2.5}, r"epochs must be an integer >= 0; received 2.5"),
    ],
)
def test_bad_fit_arguments_are_refused_before_training(options, message):
    engine, _ = pair()
    x, y = arrays()
    with pytest.raises(ValueError, match=message):
        engine.fit(x, y, **options)
    assert engine.steps_done == 0


def test_inputs_that_are_none_are_named_before_anything_runs():
    engine, _ = pair()
    x, y = arrays()
    before = engine.model.get_weights()
    expected = r"must be the inputs \(arrays, tensors, .*\); received None"
    calls = {
        "x": lambda: engine.fit(None, y, verbose=0),
        "validation_data's x": lambda: engine.fit(
            x, y, validation_data=(None, y), verbose=0
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"^{name} {expected}"):
            call()
    with pytest.raises(ValueError, match=f"^x {expected}"):
        engine.evaluate(None, y, verbose=0)
    with pytest.raises(ValueError, match=f"^x {expected}"):
        engine.predict(None, verbose=0)
    assert engine.steps_done == 0
    for got, was in zip(engine.model.get_weights(), before):
        np.testing.assert_array_equal(got, was)


def test_validation_split_of_a_dataset_is_refused_naming_the_fix():
    engine, _ = pair()
    dataset = tf.data.Dataset.from_tensor_slices(arrays()).batch(8)
    with pytest.raises(ValueError, match="Pass validation_data instead"):
        engine.fit(dataset, validation_split=0.2, verbose=0)


def epoch_orders(seed, epochs=3, examples=10):
    """The examples' order in each epoch of fit's shuffle of arrays."""
    source = source_of(np.arange(examples), batch_size=4, shuffle=True)
    source.seed = seed
    return [
        np.concatenate([b.numpy() for b in source.make_pass(e, 0)]).tolist()
        for e in range(epochs)
    ]


def test_each_epoch_is_its_own_permutation_of_every_example():
    orders = epoch_orders(seed=5)
    for order in orders:
        assert sorted(order) == list(range(10))
    assert orders[0] != orders[1] != orders[2] != list(range(10))
    assert epoch_orders(seed=5) == orders  # from (seed, epoch) alone
    assert epoch_orders(seed=6) != orders


def test_fit_shuffles_arrays_by_default_seeded_as_keras_users_seed():
    x, y = arrays()
    runs = []
    for shuffle in [True, True, False, 11]:
        engine, _ = pair()  # keras.utils.set_random_seed(0) first
        engine.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=shuffle)
        runs.append(engine.model.get_weights()[0])
    shuffled, again, ordered, seeded = runs
    np.testing.assert_array_equal(shuffled, again)  # the same seed, the same orders
    assert not np.allclose(shuffled, ordered, rtol=1e-4)
    assert not np.allclose(seeded, shuffled, rtol=1e-4)
    start = pair()[0].model.get_weights()
    keras.utils.set_random_seed(99)  # a given seed does not follow the global one
    engine = Towers(regression, "mse", keras.optimizers.SGD(0.05), devices(3))
    engine.model.set_weights(start)
    engine.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=11)
    np.testing.assert_array_equal(engine.model.get_weights()[0], seeded)


@pytest.mark.parametrize("labels", ["sparse", "one_hot", "binary"])
def test_accuracy_by_name_is_resolved_by_shapes_as_keras_compile_does(labels):
    """compile(metrics=["accuracy"]): Keras picks binary, sparse categorical or
    categorical accuracy from the targets' and predictions' shapes."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((EXAMPLES, 5)).astype("float32")
    classes = 1 if labels == "binary" else 3
    y = rng.integers(0, max(classes, 2), EXAMPLES)
    if labels == "one_hot":
        y = np.eye(3, dtype="float32")[y]
    loss = {
        "sparse": "sparse_categorical_crossentropy",
        "one_hot": "categorical_crossentropy",
        "binary": "binary_crossentropy",
    }[labels]

    def build():
        keras.utils.set_random_seed(0)
        activation = "sigmoid" if classes == 1 else "softmax"
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(classes, activation=activation)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss,
                      metrics=["accuracy", "acc"])  # fmt: skip
        return model

    want = build().fit(x, y, epochs=2, shuffle=False, verbose=0).history
    got = Towers(build(), devices=devices(3)).fit(x, y, epochs=2, shuffle=False)
    for name in ("loss", "accuracy", "acc"):
        assert_close(got[name], want[name])
    assert max(want["accuracy"]) > 0.2  # a real accuracy, not 0 from equality


def test_a_list_of_arrays_is_several_inputs_as_in_keras_fit():
    """tf.data would stack a list into one tensor; Keras reads each array as an
    input of its own."""
    rng = np.random.default_rng(5)
    first = rng.standard_normal((EXAMPLES, 4)).astype("float32")
    second = rng.standard_normal((EXAMPLES, 2)).astype("float32")
    y = rng.standard_normal((EXAMPLES, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((4,)), keras.Input((2,))
        out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
        model = keras.Model([a, b], out)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    reference, engine = build(), Towers(build(), devices=devices(3))
    want = reference.fit([first, second], y, epochs=2, shuffle=False, verbose=0)
    got = engine.fit([first, second], y, epochs=2, shuffle=False)
    assert_close(got["loss"], want.history["loss"])
    assert_same_weights(engine, reference)
    shuffled = engine.fit([first, second], y, epochs=1)  # the shuffled path too
    assert np.isfinite(shuffled["loss"]).all()


def test_a_target_dict_with_a_wrong_or_missing_output_name_is_named():
    def two_outputs():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5)(inputs)
        cls = keras.layers.Dense(3, name="cls")(hidden)
        return keras.Model(
            inputs, {"cls": cls, "reg": keras.layers.Dense(1, name="reg")(hidden)}
        )

    losses = {"cls": keras.losses.SparseCategoricalCrossentropy(True), "reg": "mse"}
    engine = Towers(two_outputs, losses, "sgd", devices=devices(2))
    before = engine.model.get_weights()
    x, labels, values = np.ones((16, 4), "f4"), np.zeros(16), np.ones((16, 1))

    with pytest.raises(ValueError) as wrong:
        engine.fit(x, {"cls": labels, "regr": values}, verbose=0)
    with pytest.raises(ValueError) as missing:
        engine.evaluate(x, {"cls": labels}, verbose=0)

    assert str(wrong.value) == (
        "y as a dict needs a target for each output with a loss (['cls', 'reg']), "
        "keyed by the model's output names ['cls', 'reg']; received keys "
        "['cls', 'regr']: ['regr'] name no output; missing ['reg']"
    )
    assert str(missing.value).endswith("received keys ['cls']; missing ['reg']")
    assert engine.steps_done == 0
    for got, was in zip(engine.model.get_weights(), before):
        np.testing.assert_array_equal(got, was)


@pytest.fixture
def keras_limits():
    """keras.config's epoch and step limits, set back to none after."""
    yield keras.config
    keras.config.set_max_epochs(None)
    keras.config.set_max_steps_per_epoch(None)


def test_keras_configs_epoch_and_step_limits_cut_fit_as_keras_fit(keras_limits):
    keras_limits.set_max_epochs(2)
    keras_limits.set_max_steps_per_epoch(2)
    x, y = arrays()  # 3 batches of Keras' default 32
    engine, model = pair()
    with pytest.warns(UserWarning, match="Limiting epochs to 2"):
        history = engine.fit(x, y, epochs=4, shuffle=False, verbose=0)
    expected = model.fit(x, y, epochs=4, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == len(expected.history["loss"]) == 2
    assert engine.steps_done == int(model.optimizer.iterations) == 4
    assert_same_weights(engine, model)
    # evaluate reads 2 batches too, as Keras' does.
    assert_close(engine.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0))

"""Keras' built-in callbacks work in ``fit`` as the Keras documentation says."""

import csv

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from towers import Towers


def classifier():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def engine_and_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 6)).astype("float32")
    y = rng.integers(0, 3, 24).astype("int32")
    engine = Towers(
        classifier,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.1),
        devices(2),
    )
    return engine, x, y


def learning_rate(engine):
    return float(np.asarray(engine.optimizer.learning_rate))


def test_learning_rate_scheduler_sets_the_rate_each_epoch():
    engine, x, y = engine_and_data()
    schedule = keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: 0.01 * (epoch + 1)
    )

    engine.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[schedule])

    assert learning_rate(engine) == pytest.approx(0.03)


def test_the_scheduled_rate_is_the_rate_the_step_uses():
    engine, x, y = engine_and_data(1)
    frozen = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0)
    before = engine.model.get_weights()

    engine.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[frozen])

    # A rate of 0 leaves every weight where it was.
    for a, b in zip(before, engine.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_reduce_lr_on_plateau_halves_the_rate_when_the_loss_stalls():
    engine, x, y = engine_and_data(2)
    # No epoch improves by 1e9: after the first (which sets the best), every epoch
    # is a plateau.
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9
    )

    engine.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[plateau])

    assert learning_rate(engine) == pytest.approx(0.1 * 0.5**2)


def test_early_stopping_stops_and_restores_the_best_weights():
    engine, x, y = engine_and_data(3)
    stop = keras.callbacks.EarlyStopping(
        monitor="val_loss", patience=1, min_delta=1e9, restore_best_weights=True
    )

    history = engine.fit(
        x,
        y,
        batch_size=8,
        epochs=10,
        verbose=0,
        validation_data=(x, y),
        callbacks=[stop],
    )

    assert len(history["loss"]) == 2  # the first epoch, then one without progress
    assert stop.stopped_epoch == 1
    best = engine.evaluate(x, y, batch_size=8, verbose=0)
    assert best == pytest.approx(history["val_loss"][0], rel=1e-5)


def test_model_checkpoint_writes_weights_keras_can_load(tmp_path):
    engine, x, y = engine_and_data(4)
    path = tmp_path / "best.weights.h5"
    save = keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True)

    engine.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[save])

    loaded = classifier()
    loaded.load_weights(str(path))
    for a, b in zip(loaded.get_weights(), engine.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_csv_logger_writes_a_row_per_epoch(tmp_path):
    engine, x, y = engine_and_data(5)
    path = tmp_path / "log.csv"

    history = engine.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[keras.callbacks.CSVLogger(str(path))],
    )

    rows = list(csv.DictReader(path.open()))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    np.testing.assert_allclose(
        [float(r["loss"]) for r in rows], history["loss"], rtol=1e-6
    )


def test_keras_tensorboard_callback_writes_the_epochs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    engine, x, y = engine_and_data(6)
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))

    engine.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[board])

    events = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    events.Reload()
    steps = [event.step for event in events.Tensors("epoch_loss")]
    assert steps == [0, 1]

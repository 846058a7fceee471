"""TensorBoard logs from fit, read back with TensorBoard's own event reader."""

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.training.test_loop import classification_data, make_engine
from towers.training.summaries import TrainingLog


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard would draw them."""
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [
            (e.step, float(tf.make_ndarray(e.tensor_proto)))
            for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }


def test_fit_logs_every_step_and_epoch_scalar(tmp_path):
    x, y = classification_data(40)  # batches of 16: 16, 16, 8
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.5)
    engine = make_engine(metrics=["sparse_categorical_accuracy"])
    engine.optimizer.learning_rate = schedule
    history = engine.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        validation_data=(x, y),
        log_dir=str(tmp_path),
    )

    train = read_scalars(tmp_path / "train")
    for tag in [
        "loss",
        "sparse_categorical_accuracy",
        "step_time",
        "examples_per_second",
        "learning_rate",
    ]:
        assert [step for step, _ in train[tag]] == [1, 2, 3, 4, 5, 6], tag
    # The learning rate is the schedule's value at the step that used it.
    np.testing.assert_allclose(
        [value for _, value in train["learning_rate"]],
        [0.01 * 0.5**i for i in range(6)],
        rtol=1e-6,
    )
    rates = np.array([v for _, v in train["examples_per_second"]])
    times = np.array([v for _, v in train["step_time"]])
    np.testing.assert_allclose(rates * times, [16, 16, 8] * 2, rtol=1e-4)
    # Per epoch: the history's values, at the epoch's last step.
    assert [step for step, _ in train["epoch_loss"]] == [3, 6]
    np.testing.assert_allclose([v for _, v in train["epoch_loss"]], history["loss"])
    validation = read_scalars(tmp_path / "validation")
    assert [step for step, _ in validation["epoch_loss"]] == [3, 6]
    for name in ["loss", "sparse_categorical_accuracy"]:
        np.testing.assert_allclose(
            [v for _, v in validation[f"epoch_{name}"]], history[f"val_{name}"]
        )


def test_fit_step_loss_in_the_log_is_the_batch_loss_before_the_update(tmp_path):
    x, y = classification_data(32)
    logged, stepped = make_engine(), make_engine()
    logged.fit(x, y, batch_size=16, verbose=0, log_dir=str(tmp_path), shuffle=False)
    expected = [
        float(stepped.train_step(x[i : i + 16], y[i : i + 16])["loss"]) for i in (0, 16)
    ]

    losses = [value for _, value in read_scalars(tmp_path / "train")["loss"]]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)


def test_fit_profiles_the_steps_asked_for(tmp_path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    x, y = classification_data(64)
    make_engine().fit(
        x, y, batch_size=16, verbose=0, log_dir=str(tmp_path), profile_steps=(2, 3)
    )

    traces = list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1, traces
    space = xplane_pb2.XSpace.FromString(traces[0].read_bytes())
    events = [
        space_plane.event_metadata[event.metadata_id].name
        for space_plane in space.planes
        for line in space_plane.lines
        for event in line.events
    ]
    # The trace holds the towers' step function (Step.train), run twice (steps 2
    # and 3).
    steps = [name for name in events if "__inference_train_" in name]
    assert len(steps) == 2, [e for e in sorted(set(events)) if "inference" in e]


@pytest.mark.parametrize(
    "profile_steps", [(0, 2), (3, 2), (1,), "1,2", (1.0, 2.0)], ids=str
)
def test_profile_steps_must_be_a_step_range(tmp_path, profile_steps):
    with pytest.raises(ValueError, match="profile_steps must be"):
        TrainingLog(make_engine(), str(tmp_path), profile_steps)


def test_profile_steps_need_a_log_dir():
    with pytest.raises(ValueError, match="needs a log_dir"):
        TrainingLog(make_engine(), None, (1, 2))


def test_fit_without_log_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = classification_data(16)
    make_engine().fit(x, y, batch_size=16, verbose=0)
    assert list(tmp_path.iterdir()) == []

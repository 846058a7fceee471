"""How the towers run is decided in one place (``towers/step/run/runner.py``):
every step's passes (towers' own train and evaluation steps, predict, a
model's own train_step) ask ``Runner.way``, and take the way it says."""

import keras
import numpy as np
import pytest

from tests.models import build_mlp
from tests.step.rules.test_gathered_loss import clip
from tests.step.rules.test_gathered_loss import data as clip_data
from tests.step.work.test_own import guide_model
from tests.test_equivalence import devices
from towers import Towers
from towers.step.run import runner as runner_module
from towers.step.run import seats
from towers.step.run.runner import Runner


@pytest.fixture
def ways(monkeypatch):
    """Every decision the runner makes: ``(kind, way)``, in order."""
    decided = []
    decide = Runner.way

    def way(self, kind, working, shards=None):
        chosen = decide(self, kind, working, shards)
        decided.append((kind, chosen))
        return chosen

    monkeypatch.setattr(Runner, "way", way)
    return decided


def batch_norm_mlp():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def regression():
    rng = np.random.default_rng(0)
    return rng.standard_normal((10, 6)), rng.standard_normal((10, 2))


def run_all(engine, x, y):
    engine.fit(x, y, batch_size=10, epochs=1, verbose=0)
    engine.evaluate(x, y, batch_size=10, verbose=0)
    engine.predict(x, batch_size=10, verbose=0)


def by_kind(decided):
    found = {}
    for kind, way in decided:
        found.setdefault(kind, set()).add(way)
    return found


@pytest.mark.parametrize(
    "build, towers, options, train, inference",
    [
        (build_mlp, 1, {}, "alone", "alone"),  # nobody to share a trace with
        (build_mlp, 3, {}, "shared", "shared"),
        (build_mlp, 3, {"placement": "replicated"}, "alone", "alone"),  # a copy each
        (build_mlp, 3, {"jit_compile": True}, "phases", "shared"),  # cut where met
        (batch_norm_mlp, 3, {"batch_statistics": "global"}, "phases", "shared"),
        (batch_norm_mlp, 1, {"batch_statistics": "global"}, "alone", "alone"),
    ],
    ids=["one", "shared", "replicated", "xla", "global", "global-alone"],
)
def test_towers_own_steps_take_the_way_the_runner_decides(
    ways, build, towers, options, train, inference
):
    engine = Towers(
        build, "mse", keras.optimizers.SGD(0.1), devices=devices(towers), **options
    )
    run_all(engine, *regression())
    # Evaluation and prediction meet nowhere (moving statistics, no sums).
    assert by_kind(ways) == {
        "train": {train},
        "evaluate": {inference},
        "predict": {inference},
    }


@pytest.mark.parametrize("examples, traces", [(12, 1), (11, 2)])
def test_a_models_own_train_step_is_traced_once_a_shard_shape_and_cut(
    ways, monkeypatch, examples, traces
):
    model = guide_model()
    seen = []  # the seat of each trace of its train_step in a tower
    train_step = type(model).train_step

    def counted(self, data):
        seen.append(type(seats.current()).__name__)
        return train_step(self, data)

    monkeypatch.setattr(type(model), "train_step", counted)
    engine = Towers(model, devices=devices(3))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((examples, 5)), rng.standard_normal((examples, 2))
    engine.fit(x, y, batch_size=examples, epochs=1, verbose=0)
    # test_step is the model's own too; predict_step is towers'.
    assert by_kind(ways)["own"] == {"phases"}
    # 4 + 4 + 4 rows: one trace for the three towers; 4 + 4 + 3: two. (The
    # probe and the first step's check call it alone: Alone seats.)
    assert seen.count("CutSeat") == traces
    assert "Seat" not in seen  # no tower traced in turns


def test_a_gathered_loss_takes_turns_in_training_and_evaluation(ways):
    engine = Towers(clip(), devices=devices(3))
    x, y = clip_data()
    run_all(engine, x, y)
    assert by_kind(ways) == {
        "train": {"turns"},
        "evaluate": {"turns"},
        "predict": {"shared"},
    }


def test_a_pass_that_cannot_be_cut_takes_turns_without_xla(monkeypatch):
    taken = []
    in_turns = runner_module.in_turns

    def uncuttable(*args):
        raise runner_module.seats.Unserved("forced by the test")

    monkeypatch.setattr(runner_module.phases, "compute", uncuttable)
    monkeypatch.setattr(
        runner_module, "in_turns", lambda *args: taken.append(1) or in_turns(*args)
    )
    engine = Towers(
        batch_norm_mlp,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=devices(2),
        batch_statistics="global",
    )
    engine.train_step(*regression())
    assert taken == [1]

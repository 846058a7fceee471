"""Global batch statistics without XLA trace a tower's pass once per shard
shape and cut it where the towers meet (``towers/step/run/phases.py``), as the
XLA path does; a pass that cannot be cut falls back to the lockstep, which
traces every tower. The cut pass gives the lockstep's numbers, random draws
after the towers' sums included (both one device's: test_draws.py)."""

import keras
import numpy as np
import pytest

from towers import Towers
from towers.step.run import phases, runner, seats


class Counting(keras.layers.Layer):
    """The identity, counting how many times Python runs its ``call``."""

    calls = 0

    def call(self, x):
        Counting.calls += 1
        return x


def model(dropout: bool):
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, use_bias=False)(Counting()(inputs))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.5)(x))
    if dropout:  # draws after the towers' sums
        x = keras.layers.Dropout(0.3, seed=3)(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def trained(statistics, towers, dropout=False, examples=12):
    keras.utils.set_random_seed(1)
    Counting.calls = 0
    engine = Towers(
        model(dropout),
        "mse",
        keras.optimizers.SGD(0.1),
        devices=[f"/cpu:{t}" for t in range(towers)],
        batch_statistics=statistics,
        check_first_step=False,  # its one-device trace would be counted too
    )
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = (rng.standard_normal((examples, 5)) * 3 + 1).astype("float32")
        engine.train_step(x, rng.standard_normal((examples, 1)).astype("float32"))
    return Counting.calls, [v.numpy() for v in engine.model.variables]


def test_global_statistics_trace_the_pass_once_per_shard_shape():
    tower_traces, _ = trained("tower", 4)
    global_traces, _ = trained("global", 4)
    assert global_traces == tower_traces  # not once per tower


def test_the_lockstep_traces_every_tower(monkeypatch):
    tower_traces, _ = trained("tower", 4)  # one trace, as above
    monkeypatch.setattr(phases, "compute", _uncuttable)
    global_traces, _ = trained("global", 4)
    assert global_traces == tower_traces + 3


@pytest.mark.parametrize("towers, examples", [(3, 12), (4, 10)])
@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "draws"])
def test_the_cut_pass_gives_the_locksteps_numbers(
    monkeypatch, towers, examples, dropout
):
    fallbacks = []
    fallback = runner.in_turns
    counted = lambda *a: fallbacks.append(1) or fallback(*a)  # noqa: E731
    monkeypatch.setattr(runner, "in_turns", counted)
    _, cut = trained("global", towers, dropout, examples)
    assert not fallbacks  # cut, draws included: every tower starts alike
    monkeypatch.setattr(phases, "compute", _uncuttable)
    _, lockstep_numbers = trained("global", towers, dropout, examples)
    assert len(fallbacks) == 1
    for ours, theirs in zip(cut, lockstep_numbers, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def _uncuttable(*arguments):
    raise seats.Unserved("forced by the test")

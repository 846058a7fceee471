import keras
import numpy as np

from tests.models import build_mlp, regression_batch
from towers import Towers
from towers.bench.phases import time_phases


def test_every_phase_is_timed_and_apply_and_step_really_ran():
    engine = Towers(
        build_mlp, "mse", keras.optimizers.SGD, devices=["/cpu:0", "/cpu:1"]
    )
    x, y = regression_batch(np.random.default_rng(0), 8)

    phases = time_phases(engine, x, y, repeats=4)

    assert sorted(phases) == ["apply", "combine", "compute", "step"]
    assert all(ms > 0 for ms in phases.values())
    # apply and step each ran 3 warm-up calls and 4 timed ones.
    assert int(engine.optimizer.iterations.numpy()) == 14

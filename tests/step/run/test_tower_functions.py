"""Towers(tower_functions="call"): each tower's traced pass stays a call of
its own in the step's graph instead of being inlined (step/run/phases.py), which
TensorFlow optimises per tower rather than as one graph of T copies; the
numbers are the inlined step's, bit for bit."""

import keras
import numpy as np
import pytest

from tests.test_equivalence import devices
from towers import Towers
from towers._runtime import placed_graphs


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
         keras.layers.Dropout(0.3), keras.layers.Dense(3)]
    )  # fmt: skip


@pytest.mark.usefixtures("float64")
def test_called_towers_train_to_the_inlined_ones_weights_bit_for_bit():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((23, 5)), rng.standard_normal((23, 3))
    weights = {}
    for mode in ("inline", "call"):
        engine = Towers(
            model(), "mse", keras.optimizers.Adam(0.01), devices(3),
            tower_functions=mode,
        )  # fmt: skip
        engine.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights[mode] = engine.model.get_weights()
    for inlined, called in zip(weights["inline"], weights["call"], strict=True):
        np.testing.assert_array_equal(called, inlined)


@pytest.mark.parametrize("mode, calls", [("inline", 0), ("call", 3)])
def test_each_tower_calls_its_pass_only_when_asked(mode, calls):
    engine = Towers(model(), "mse", "sgd", devices(3), tower_functions=mode)
    x, y = np.ones((6, 5), "f4"), np.ones((6, 3), "f4")
    engine.prepare(x, y)
    with placed_graphs() as functions:  # the graphs TensorFlow placed
        engine.train_step(x, y)
    ops = [node.op for function in functions for part in function for node in part.node]
    assert (
        sum(op in ("PartitionedCall", "StatefulPartitionedCall") for op in ops) == calls
    )


def test_an_unknown_tower_functions_is_named():
    with pytest.raises(
        ValueError, match="tower_functions must be 'inline' or 'call'; received 'both'"
    ):
        Towers(model(), "mse", "sgd", devices(2), tower_functions="both")

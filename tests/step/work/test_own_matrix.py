"""Every engine option with a model's own train_step, against Keras' own
fit on one device in float64: placements, reducers, accumulate_steps,
on_nonfinite and steps_per_execution, in combinations that take each value
at least once (jit_compile=True is refused by name: test_custom_steps.py).
The step's tail after the gradients (the placement's combine, the update's
policies and steps count) is the built-in step's, so each combination is
Keras' fit's update."""

import numpy as np
import pytest

from tests.step.work.test_own import regression
from tests.step.work.test_own_options import executing
from tests.step.work.test_own_state import assert_every_variable_moved_alike
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=7, epochs=2, shuffle=False, verbose=0)

COMBINATIONS = {
    "central per_tensor": dict(placement="central", reducer="per_tensor"),
    "balanced packed, 3 an execution": dict(
        placement="balanced", reducer="packed", steps_per_execution=3
    ),
    "central sharded, windows of 2": dict(reducer="sharded", accumulate_steps=2),
    "balanced skip, windows of 2": dict(
        placement="balanced", on_nonfinite="skip", accumulate_steps=2
    ),
    "central raise, 2 an execution": dict(
        on_nonfinite="raise", steps_per_execution=2, jit_compile=False
    ),
    "replicated packed, 2 an execution": dict(
        placement="replicated", reducer="packed", steps_per_execution=2
    ),
}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_each_combination_of_options_trains_an_own_step_as_keras_fit(name):
    # Batches of 7, 7, 7, 3 on 3 towers: uneven shards, a last batch that
    # leaves no tower idle. With windows of two, Keras' reference takes the
    # windows as batches of 14 and 10 (the examples-weighted mean of two).
    options = dict(COMBINATIONS[name])
    per_execution = options.pop("steps_per_execution", 1)
    window = options.get("accumulate_steps", 1)
    x, y = regression(24)
    # A builder: balanced and replicated build the model where it lives.
    engine = Towers(lambda: executing(per_execution), devices=devices(3), **options)
    reference = executing(per_execution)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **{**FIT, "batch_size": 7 * window})

    assert_every_variable_moved_alike(engine.model, reference, before)
    assert int(engine.model.optimizer.iterations) == 8 // window
    assert engine.steps_done == 8
    # A streaming metric sees each example once, as one batch's.
    np.testing.assert_allclose(
        history.history["mae"], expected.history["mae"], rtol=1e-10
    )
    # The guide's loss tracker takes a number per batch it sees: with windows,
    # Keras' sees the windows'. With a copy per tower too, the towers'
    # numbers are weighted by their shares, one update of copy 0's tracker.
    if window == 1:
        np.testing.assert_allclose(
            history.history["loss"], expected.history["loss"], rtol=1e-10
        )

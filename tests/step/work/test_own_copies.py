"""A model's own train_step with a copy of the model per tower: replicated
(the towers' weighted gradients all-reduced at each apply, every copy
applying the sum with its own optimizer) against Keras' own fit on one
device, float64, uneven shards; independent (nothing exchanged) as the
floor it is (towers/step/work/copies.py)."""

import numpy as np
import pytest

from tests.step.work.test_own import (
    assert_same_updates,
    gan,
    guide_model,
    regression,
)
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_gan_trains_replicated_as_keras_fit(num_towers):
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((29, 2)), rng.standard_normal((29, 3))
    engine = Towers(gan, devices=devices(num_towers), placement="replicated")
    reference = gan()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8, 8, 8, 5
    history = engine.fit(real, z, **fit)
    expected = reference.fit(real, z, **fit)

    # Copy 0 is one device's, and every copy is copy 0, slots included.
    assert_same_updates(engine.model, reference, before)
    for copy in engine.placement.models[1:]:
        for got, want in zip(copy.get_weights(), engine.model.get_weights()):
            np.testing.assert_array_equal(got, want)
        for name in ("d_optimizer", "g_optimizer"):
            mine, first = getattr(copy, name), getattr(engine.model, name)
            assert int(mine.iterations) == int(first.iterations) == 8
            for v, w in zip(mine.variables, first.variables, strict=True):
                np.testing.assert_array_equal(v.numpy(), w.numpy())
    assert sorted(history.history) == ["d_loss", "g_loss"]
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-12)


def test_the_guides_step_trains_replicated_as_keras_fit_with_its_metrics():
    x, y = regression(23)  # batches of 8, 8, 7
    engine = Towers(guide_model, devices=devices(3), placement="replicated")
    reference = guide_model()
    before = reference.get_weights()

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = engine.fit(x, y, **fit)
    expected = reference.fit(x, y, **fit)

    assert_same_updates(engine.model, reference, before)
    # The copies' metric updates gathered into copy 0's: the mean absolute
    # error streams over every example, the loss tracker takes each batch's
    # number once (the towers' weighted by their shares), as on one device.
    for key in ("mae", "loss"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-12
        )


def test_independent_copies_each_train_on_their_own_shard():
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((16, 2)), rng.standard_normal((16, 3))
    engine = Towers(gan, devices=devices(2), placement="independent")
    start = engine.model.get_weights()
    engine.fit(real, z, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first, second = (m.get_weights() for m in engine.placement.models)
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(first, start))
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(first, second))


def test_independent_copies_with_batchnorm_each_move_their_own_statistics():
    from tests.step.work.test_own_batchnorm import NormalisedGAN

    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((16, 2)), rng.standard_normal((16, 3))
    build = lambda: gan(cls=NormalisedGAN)  # noqa: E731
    engine = Towers(build, devices=devices(2), placement="independent")
    history = engine.fit(real, z, batch_size=8, shuffle=False, verbose=0)
    assert all(np.isfinite(v).all() for v in history.history["d_loss"])
    means = [
        [v.numpy() for v in m.weights if v.name == "moving_mean"]
        for m in engine.placement.models
    ]
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(*means))


def test_a_replicated_gan_is_refused_by_name_where_it_cannot_resume(tmp_path):
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((16, 2)), rng.standard_normal((16, 3))
    run = dict(batch_size=8, verbose=0, checkpoint_dir=str(tmp_path))
    Towers(gan, devices=devices(2), placement="replicated").fit(real, z, **run)
    resumed = Towers(gan, devices=devices(2), placement="replicated")
    with pytest.raises(
        ValueError,
        match=r"cannot resume a model whose own "
        r"optimizers \(.*\) are built at their first apply",
    ):
        resumed.fit(real, z, epochs=2, **run)
    assert resumed.steps_done == 2  # restored, and no step after it


def test_a_model_compiled_optimizer_resumes_replicated(tmp_path):
    # The guide's step applies with its compiled optimizer, the engine's:
    # restored into copy 0 and copied to the others.
    x, y = regression(16)
    run = dict(batch_size=8, shuffle=False, verbose=0, checkpoint_dir=str(tmp_path))
    Towers(guide_model, devices=devices(2), placement="replicated").fit(x, y, **run)
    resumed = Towers(guide_model, devices=devices(2), placement="replicated")
    resumed.fit(x, y, epochs=2, **run)
    straight = Towers(guide_model, devices=devices(2), placement="replicated")
    straight.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    for engine in (resumed, straight):
        for copy in engine.placement.models:
            for got, want in zip(copy.get_weights(), straight.model.get_weights()):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)

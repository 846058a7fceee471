"""BatchNormalization given a mask, and with renorm=True, on towers against
Keras' own fit on one device in float64 (towers/step/rules/batchnorm.py): masked
values are left out of the moments, under tower and global statistics alike,
and a renorm layer moves its renorm statistics by its own rule, once a step."""

import keras
import numpy as np
import pytest

from tests.step.work.test_own_state import assert_every_variable_moved_alike
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=9, shuffle=False, verbose=0)


def sequences(examples, seed=0):
    """``[B, 5, 3]`` sequences padded with zeros after a random length (1 to
    5), and targets ``[B, 1]``. The padded steps are masked by the model."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, 5, 3)) * 2 + 1
    lengths = rng.integers(1, 6, examples)
    x[np.arange(5)[None, :] >= lengths[:, None]] = 0.0
    return x, rng.standard_normal((examples, 1))


def masked_model(**batch_norm):
    """Masking, a Dense (it passes the mask on), BatchNormalization, and a
    pooling that reads the mask too."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((5, 3)),
            keras.layers.Masking(0.0),
            keras.layers.Dense(4, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5, name="bn", **batch_norm),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def trained_alike(batch_statistics, num_towers, examples, epochs, **batch_norm):
    """Fits the same model with towers and with Keras on one device; returns
    both, the reference's variables before, and both Histories."""
    x, y = sequences(examples)
    reference = masked_model(**batch_norm)
    before = [v.numpy() for v in reference.variables]
    engine = Towers(
        masked_model(**batch_norm),
        devices=devices(num_towers),
        batch_statistics=batch_statistics,
    )
    history = engine.fit(x, y, epochs=epochs, **FIT)
    expected = reference.fit(x, y, epochs=epochs, **FIT)
    return engine.model, reference, before, history.history, expected.history


@pytest.mark.parametrize("renorm", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("num_towers", [2, 3])
def test_global_statistics_train_a_masked_layer_as_keras_fit(num_towers, renorm):
    # Batches of 9, 9, 4: uneven shards, some of whose steps are all masked.
    model, reference, before, history, expected = trained_alike(
        "global", num_towers, 22, 2, renorm=renorm
    )
    assert_every_variable_moved_alike(model, reference, before)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-10)


@pytest.mark.parametrize("renorm", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("num_towers", [2, 3])
def test_tower_statistics_move_a_masked_layer_by_the_whole_batch(num_towers, renorm):
    # One step: each tower normalises with its own shard, so the weights part
    # from one device's; the moving statistics are still the whole batch's,
    # from the same layer inputs, as Keras' one step moves them.
    model, reference, before, _, _ = trained_alike(
        "tower", num_towers, 9, 1, renorm=renorm
    )
    layer, expected = model.get_layer("bn"), reference.get_layer("bn")
    initial = dict(zip([v.path for v in reference.variables], before))
    moved = expected.non_trainable_variables
    assert len(moved) == (5 if renorm else 2)
    for got, want in zip(layer.non_trainable_variables, moved):
        assert not np.allclose(got.numpy(), initial[want.path])  # it moved
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)


def test_a_tower_whose_values_are_all_masked_weighs_nothing():
    x, y = sequences(8)
    x[4:] = 0.0  # the second tower's shard: every step masked
    reference = masked_model()
    engine = Towers(masked_model(), devices=devices(2))
    engine.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    reference.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    for got, want in zip(
        engine.model.get_layer("bn").non_trainable_variables,
        reference.get_layer("bn").non_trainable_variables,
    ):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)

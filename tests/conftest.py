"""Fixtures shared by several test modules."""

import keras
import pytest

from tests.shuffled_run import uninterrupted_run


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The shuffled script's 3 epochs, never stopped (tests/shuffled_run.py)."""
    return uninterrupted_run(tmp_path_factory)


@pytest.fixture(scope="session")
def uninterrupted_arrays(tmp_path_factory):
    """The same, on arrays that fit shuffles every epoch (its default)."""
    return uninterrupted_run(tmp_path_factory, data="--arrays")


@pytest.fixture
def xla_allowed():
    """Op determinism off while the test runs: the suite turns it on
    (conftest.py at the root), and Keras' compile then refuses XLA, so a
    comparison with Keras' XLA fit would silently run without it."""
    from tensorflow.python.framework import config

    config.disable_op_determinism()
    try:
        yield
    finally:
        config.enable_op_determinism()


@pytest.fixture
def float64():
    """Keras' floatx and dtype policy float64 while the test runs. The dtype
    policy too: once set explicitly (the mixed-precision tests set it back to
    "float32"), it no longer follows floatx."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)

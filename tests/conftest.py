"""Fixtures shared by several test modules."""

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

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

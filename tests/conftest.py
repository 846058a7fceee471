"""Fixtures shared by several test modules, and the slow tier's tests."""

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


# The tests `make test-slow` runs and `make test` leaves to it (CI runs both):
# each starts real processes (a cluster's workers, a run killed and resumed,
# the bench CLI), builds real models or compiles with XLA, for 10-140 s each
# on two cores. By module, or by test.
SLOW = {
    "tests/cluster/test_cluster_jobs.py": "a cluster of worker processes each",
    "tests/training/test_resume.py": "runs killed and resumed in processes",
    "tests/training/test_random_kills.py": "ten kills of a running process",
    "tests/bench/test_bench_cli.py": "the bench CLI's full run",
    "tests/test_real_models.py": "keras.applications and keras_hub models",
    "tests/step/test_coupled.py": "keras_hub's mixture-of-experts models",
    "tests/step/test_segments.py": "XLA compilations of cut passes",
    "tests/step/test_xla.py": "XLA compilations against Keras' XLA fit",
    "tests/step/test_cut.py::test_a_recurrent_model_trains_with_xla_as_keras_xla_fit": (
        "recurrent layers' XLA compilations"
    ),
    "tests/step/test_cut.py::test_a_loops_kept_values_between_xla_phases_are_named_"
    "or_run_without_xla": "recurrent layers' XLA compilations",
    "tests/training/test_loop.py::test_sigkill_mid_epoch_then_resume_equals_an_"
    "uninterrupted_run": "a run killed and resumed in processes",
}


def pytest_collection_modifyitems(config, items):
    """Marks the :data:`SLOW` tests ``slow``."""
    for item in items:
        if any(
            item.nodeid == key or item.nodeid.startswith(key + "::") for key in SLOW
        ):
            item.add_marker(pytest.mark.slow)

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
# on two cores; or runs at more towers a case the fast tier runs at two. By
# module, or by test.
SLOW = {
    "tests/cluster/test_cluster_jobs.py": "a cluster of worker processes each",
    "tests/training/test_resume.py": "runs killed and resumed in processes",
    "tests/training/test_random_kills.py": "ten kills of a running process",
    "tests/bench/test_bench_cli.py": "the bench CLI's full run",
    "tests/test_real_models.py": "keras.applications and keras_hub models",
    "tests/step/rules/test_coupled.py": "keras_hub's mixture-of-experts models",
    "tests/step/run/test_phases.py": "XLA compilations of cut passes",
    "tests/step/run/test_xla.py": "XLA compilations against Keras' XLA fit",
    "tests/step/run/test_cut.py::test_a_recurrent_model_trains_with_xla_as_keras_"
    "xla_fit": "recurrent layers' XLA compilations",
    "tests/step/run/test_cut.py::test_a_loops_kept_values_between_xla_phases_are_"
    "named_or_run_without_xla": "recurrent layers' XLA compilations",
    "tests/training/test_loop.py::test_sigkill_mid_epoch_then_resume_equals_an_"
    "uninterrupted_run": "a run killed and resumed in processes",
    "tests/step/run/test_xla_cache.py": "XLA compilations counted across towers",
    "tests/cluster/test_workers.py::test_fit_shuffles_arrays_in_the_chiefs_order_"
    "on_every_worker": "a cluster of worker processes",
    "tests/test_docs.py::test_make_docs_builds_the_reference_without_warnings": (
        "the reference docs built in a process"
    ),
    "tests/test_cli.py::test_a_command_starts_quietly_unless_asked": (
        "two CLI commands in fresh processes"
    ),
    "tests/step/rules/test_probe.py::test_a_deep_float32_networks_own_step_is_found_a_"
    "mean_and_trains_as_keras_fit": "twenty blocks traced in an own step",
    "tests/step/work/test_own.py::test_a_gan_resumed_from_its_checkpoint_"
    "trains_as_one_never_stopped": "a GAN trained, saved and resumed twice",
    "tests/step/rules/test_gathered_loss.py::test_auto_xla_runs_a_gathered_loss_"
    "without_it_saying_so": "a gathered loss's XLA compilations",
    **{
        f"tests/bench/test_workers.py::{name}": "a 2-worker bench job in processes"
        for name in (
            "test_the_job_measures_towers_and_its_exchange",
            "test_the_cpu_floor_is_every_workers_cpu_over_the_cores",
            "test_mwms_trains_the_same_model_in_the_same_processes",
        )
    },
    # More towers of a case whose two towers stay in the fast tier.
    **{
        f"tests/step/{case}[{param}]": "more towers of a case run at two"
        for case, params in {
            "run/test_cut.py::test_a_recurrent_model_trains_as_keras_fit": (
                "3-shared",
                "3-phases",
            ),
            "rules/test_gathered_loss.py::test_a_clip_loss_trains_to_keras_fit_on_the_"
            "whole_batch": ("3",),
            "rules/test_gathered_loss.py::test_a_coupled_loss_in_the_models_own_step_"
            "trains_as_keras_fit": ("3",),
            "work/test_own_batchnorm.py::test_a_gan_with_batchnorm_trains_as_"
            "keras_fit_with_global_statistics": ("3",),
            "work/test_own_draws.py::test_keras_ios_ddim_as_written_trains_as_"
            "keras_fit": ("4",),
            "work/test_own_copies.py::test_a_gan_trains_replicated_as_keras_fit": (
                "3",
            ),
            "work/test_own.py::test_a_gan_with_two_optimizers_trains_as_keras_fit": (
                "3",
            ),
            "rules/test_gather.py::test_a_contrastive_loss_in_the_step_trains_as_keras_fit_"
            "when_gathered": ("3-activity", "3-"),
        }.items()
        for param in params
    },
}


def pytest_collection_modifyitems(config, items):
    """Marks the :data:`SLOW` tests ``slow``, and each case at more than two
    towers whose two towers the fast tier runs (its other parameters alike)."""
    at_two = {_case(item) for item in items if _towers(item) == 2}
    for item in items:
        if any(
            item.nodeid == key or item.nodeid.startswith(key + "::") for key in SLOW
        ) or ((_towers(item) or 0) > 2 and _case(item) in at_two):
            item.add_marker(pytest.mark.slow)


_TOWERS = ("num_towers", "towers")


def _towers(item) -> int | None:
    """The tower count a parametrized test runs at, if it takes one."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    count = next((params[name] for name in _TOWERS if name in params), None)
    return count if isinstance(count, int) else None


def _case(item) -> tuple:
    """A test and its parameters but the tower count."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    others = tuple(sorted((k, repr(v)) for k, v in params.items() if k not in _TOWERS))
    return item.nodeid.split("[")[0], others

"""Test-wide set-up that must happen before TensorFlow initialises its devices."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import towers  # noqa: E402

# Eight logical CPUs: enough for every tower count the suite tests (1, 2, 3, 4, 8).
NUM_LOGICAL_CPUS = 8
towers.virtual_devices(NUM_LOGICAL_CPUS)
keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()


def make_engine(**options):
    """The engine of ``towers.Towers``' docstring example: a Dense(1) on 3 inputs,
    "mse", SGD(0.1), on two logical CPUs; ``options`` are passed on to Towers."""
    return towers.Towers(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        loss="mse",
        optimizer=keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
        **options,
    )


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    # The docstrings share one engine fixture rather than each building its own.
    doctest_namespace["make_engine"] = make_engine
    doctest_namespace["np"] = np

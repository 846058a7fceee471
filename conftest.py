"""Test-wide set-up that must happen before TensorFlow initialises its devices."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import towers  # noqa: E402

# Eight logical CPUs: enough for every tower count the suite tests (1, 2, 3, 4, 8).
NUM_LOGICAL_CPUS = 8
towers.virtual_devices(NUM_LOGICAL_CPUS)
keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()

"""XLA on several towers compiles each shard shape once where TensorFlow's
persistent XLA cache is on (``towers/step/run/xla.py``): the first tower's pass is
compiled and saved before the step runs, and the other towers load it. Each
run is a fresh process, since the cache is read from ``TF_XLA_FLAGS`` when
TensorFlow starts; TensorFlow's own log says what it compiled and what it
loaded."""

import json
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = """
import json, sys
from towers.devices import virtual_devices
towers_count, batch = int(sys.argv[1]), int(sys.argv[2])
devices = virtual_devices(towers_count)
import keras, numpy as np
import towers
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                          keras.layers.Dense(3)])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Not checked against one device: the check's own XLA step would be counted.
engine = towers.Towers(model, loss, keras.optimizers.SGD(0.1), devices=devices,
                       jit_compile=True, check_first_step=False)
rng = np.random.default_rng(1)
x = rng.standard_normal((batch, 6)).astype("float32")
y = rng.integers(0, 3, batch)
engine.train_step(x, y)
print(json.dumps([w.numpy().tolist() for w in model.weights]))
"""


def _train(tmp_path, towers, batch, cache: bool):
    env = {"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "0"}
    if cache:
        directory = tmp_path / "xla_cache"
        directory.mkdir(exist_ok=True)
        env["TF_XLA_FLAGS"] = f"--tf_xla_persistent_cache_directory={directory}"
        env["TF_CPP_VMODULE"] = "device_executable_persistor=2"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(towers), str(batch)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    weights = json.loads(done.stdout.strip().splitlines()[-1])
    saved = done.stderr.count("Serializing and saving cache entry")
    loaded = done.stderr.count("Loading cached entry")
    return weights, saved, loaded


@pytest.mark.parametrize("towers, batch, shapes", [(4, 16, 1), (3, 8, 2)])
def test_each_shard_shape_compiles_once_and_the_other_towers_load_it(
    tmp_path, towers, batch, shapes
):
    weights, saved, loaded = _train(tmp_path, towers, batch, cache=True)
    assert saved == shapes  # one compilation per shard shape, not per tower
    # The towers on another device than the shape's first load it.
    assert loaded == towers - shapes
    reference, _, _ = _train(tmp_path, towers, batch, cache=False)
    for ours, theirs in zip(weights, reference):
        np.testing.assert_array_equal(ours, theirs)

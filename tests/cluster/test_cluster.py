"""towers.Cluster, TF_CONFIG and shard, in this process (no runtime started).

The jobs with real worker processes are in test_cluster_jobs.py.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from towers.cluster.cluster import Cluster, resolve_cluster, shard

WORKERS = ["127.0.0.1:2222", "127.0.0.1:2223", "127.0.0.1:2224"]


def config(cluster, task):
    return json.dumps({"cluster": cluster, "task": task})


def test_tf_config_gives_the_workers_in_order_and_this_rank():
    cluster = Cluster.from_tf_config(
        config({"worker": WORKERS}, {"type": "worker", "index": 2})
    )
    assert cluster.workers == WORKERS
    assert (cluster.index, cluster.num_workers, cluster.is_chief) == (2, 3, False)


def test_a_chief_job_is_worker_zero():
    text = config(
        {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, {"type": "worker", "index": 1}
    )
    cluster = Cluster.from_tf_config(text)
    assert cluster.workers == ["c:1", "w:1", "w:2"] and cluster.index == 2
    chief = Cluster.from_tf_config(
        config({"chief": ["c:1"], "worker": ["w:1"]}, {"type": "chief", "index": 0})
    )
    assert chief.index == 0 and chief.is_chief


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "TF_CONFIG must be JSON; received '{not json'"),
        (json.dumps({"task": {"type": "worker"}}), "must have a 'cluster' object"),
        (config({"ps": ["a:1"], "worker": ["b:1"]}, {}), "received jobs ['ps']"),
        (config({"worker": "a:1"}, {}), 'must be a list of "host:port"'),
        (config({"worker": ["a:1"]}, None), "must have a 'task' object"),
        (config({"worker": ["a:1"]}, {"type": "chief"}), "received 'chief'"),
        (
            config({"worker": ["a:1", "b:2"]}, {"type": "worker", "index": 2}),
            "must be in 0..1 for the 2 'worker' tasks; received 2",
        ),
        (config({"worker": ["a:1"]}, {"type": "worker", "index": "0"}), "integer"),
        (config({"worker": ["a"]}, {"type": "worker", "index": 0}), "received 'a'"),
        (
            config({"worker": ["a:99999"]}, {"type": "worker", "index": 0}),
            "port in 1..65535; received 'a:99999'",
        ),
        (
            config({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}),
            "must differ; received ['a:1']",
        ),
        (config({"chief": ["a:1", "b:1"]}, {"type": "chief"}), "one chief; received 2"),
    ],
)
def test_a_malformed_tf_config_says_what_is_wrong(text, says):
    with pytest.raises(ValueError) as error:
        Cluster.from_tf_config(text)
    assert says in str(error.value)


def test_no_tf_config_means_one_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert resolve_cluster("auto") is None
    assert resolve_cluster(None) is None
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        Cluster.from_tf_config()
    with pytest.raises(ValueError, match="received 'yes'"):
        resolve_cluster("yes")


def test_a_cluster_of_one_worker_is_one_process():
    assert resolve_cluster(Cluster(["127.0.0.1:1"], 0)) is None


@pytest.mark.parametrize("timeout", [0, -1, "5"])
def test_timeouts_must_be_positive(timeout):
    with pytest.raises(ValueError, match="timeout_seconds must be > 0"):
        Cluster(WORKERS, 0, timeout_seconds=timeout)


def test_the_startup_timeout_comes_from_the_environment_unless_given(monkeypatch):
    config = json.dumps(
        {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}}
    )
    assert Cluster.from_tf_config(config).startup_timeout_seconds == 300.0
    monkeypatch.setenv("TOWERS_STARTUP_TIMEOUT", "45")
    assert Cluster.from_tf_config(config).startup_timeout_seconds == 45.0
    given = Cluster.from_tf_config(config, startup_timeout_seconds=9)
    assert given.startup_timeout_seconds == 9.0
    monkeypatch.setenv("TOWERS_STARTUP_TIMEOUT", "soon")
    with pytest.raises(
        ValueError, match=r"TOWERS_STARTUP_TIMEOUT must be a number .*'soon'"
    ):
        Cluster.from_tf_config(config)


def test_a_port_in_use_is_named_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cluster = Cluster([f"127.0.0.1:{port}", "127.0.0.1:1"], index=0)
        with pytest.raises(RuntimeError) as error:
            cluster.start()
    message = str(error.value)
    assert f"worker 0's port {port} (127.0.0.1:{port}, from TF_CONFIG) is in use" in (
        message
    )


def test_starting_after_tensorflow_initialised_says_how_to_fix_it():
    # conftest.py has initialised TensorFlow in this process.
    tf.constant(1.0)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cluster = Cluster([f"127.0.0.1:{port}", "127.0.0.1:1"], index=0)
    with pytest.raises(RuntimeError, match="must start before TensorFlow initialises"):
        cluster.start()


def batches(sizes):
    data = np.arange(sum(sizes) * 2, dtype="float32").reshape(-1, 2)
    bounds = np.cumsum([0, *sizes])
    return tf.data.Dataset.from_generator(
        lambda: ((data[a:b], data[a:b, 0]) for a, b in zip(bounds, bounds[1:])),
        output_signature=(
            tf.TensorSpec((None, 2), tf.float32),
            tf.TensorSpec((None,), tf.float32),
        ),
    )


@pytest.mark.parametrize("workers", [2, 3])
def test_shards_in_rank_order_are_each_global_batch(workers):
    sizes = [13, 7, 1, 10]
    shares = [
        list(shard(batches(sizes), Cluster(WORKERS[:workers], w)))
        for w in range(workers)
    ]
    for step, (x, y) in enumerate(batches(sizes)):
        parts = [shares[w][step] for w in range(workers)]
        lengths = [int(p[0].shape[0]) for p in parts]
        assert sum(lengths) == sizes[step] and max(lengths) - min(lengths) <= 1
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    # 13 over 2: the first worker takes the extra example.
    if workers == 2:
        assert [int(s[0][0].shape[0]) for s in shares] == [7, 6]


def test_shard_without_a_cluster_is_the_dataset():
    data = batches([3])
    assert shard(data, None) is data
    with pytest.raises(ValueError, match="received ndarray"):
        shard(np.zeros(3), Cluster(WORKERS, 0))


def test_a_tensorflow_without_the_runtime_calls_fails_with_its_version(monkeypatch):
    from tensorflow.python.eager import context

    from towers import _runtime

    monkeypatch.setattr(context, "context", lambda: object())
    with pytest.raises(RuntimeError) as error:
        _runtime.start(["127.0.0.1:1", "127.0.0.1:2"], 0)
    assert f"with TensorFlow {tf.__version__}: its eager context has no" in str(
        error.value
    )


def test_an_optimizer_made_before_the_engine_in_a_cluster_is_named_with_the_fix():
    # A fresh process: making the optimizer starts TensorFlow before the cluster.
    script = (
        "import json, os\n"
        "os.environ['TF_CONFIG'] = json.dumps({'cluster': {'worker': "
        "['127.0.0.1:1', '127.0.0.1:2']}, 'task': {'type': 'worker', 'index': 0}})\n"
        "import keras, towers\n"
        "optimizer = keras.optimizers.Adam(1e-3)\n"
        "towers.Towers(lambda: keras.Sequential([keras.Input((2,)), "
        "keras.layers.Dense(1)]), 'mse', optimizer)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )

    assert done.returncode != 0
    assert (
        "making the optimizer started it: received the optimizer Adam, made before "
        "towers.Towers. Pass a zero-arg function instead (optimizer=lambda: "
        "keras.optimizers.Adam(...))" in done.stderr
    ), done.stderr[-2000:]

"""The other workers, as one engine meets them (towers/cluster/workers.py), in
this process.

Sums across real worker processes are tested in test_cluster_jobs.py; here a
cluster of one worker runs the same collectives, and what a cluster refuses is
checked before anything starts.
"""

import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from towers import Towers
from towers.cluster.cluster import Cluster
from towers.cluster.faults import WorkerLostError
from towers.cluster.workers import Workers, join_workers

WORKERS = ["127.0.0.1:2222", "127.0.0.1:2223"]


@pytest.mark.parametrize(
    "options, refused",
    [
        (dict(placement="balanced"), "placement='balanced'"),
        (dict(build="bn"), "BatchNormalization layers with batch_statistics='tower'"),
    ],
)
def test_what_a_cluster_cannot_do_yet_is_refused(options, refused):
    layers = [keras.Input((3,)), keras.layers.Dense(2)]
    if options.pop("build", None) == "bn":
        layers.insert(1, keras.layers.BatchNormalization())
    engine = Towers(
        lambda: keras.Sequential(layers),
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
        cluster=None,
        **options,
    )
    batch_norm = bool(engine.moving_statistics.layers)
    with pytest.raises(ValueError) as error:
        join_workers(Cluster(WORKERS, 0), engine.placement, batch_norm, "/cpu:0")
    assert f"a cluster of workers does not support {refused} yet" in str(error.value)


def test_one_process_joins_no_workers():
    engine = Towers(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:0"],
        cluster=None,
    )
    assert engine.workers is None
    assert join_workers(None, engine.placement, False, "/cpu:0") is None


def alone():
    """A cluster of one worker: its collectives run with no peer to wait for."""
    return Workers(Cluster(["127.0.0.1:1"], index=0), "/cpu:0")


@pytest.mark.parametrize("weight", [4.0, None])  # a mean of 4 examples, or a sum
def test_step_sums_weighted_gradients_loss_and_examples(weight):
    workers = alone()
    grad = tf.constant([1.0, -2.0])
    slices = tf.IndexedSlices(tf.constant([[3.0]]), tf.constant([1]), [2, 1])

    @tf.function
    def step():
        extras = [tf.constant([7.0])]
        summed = workers.step([grad, None, slices], tf.constant(0.5), 4, extras, weight)
        return vars(summed)  # a dataclass does not leave a tf.function

    summed = step()

    # One worker of 4 examples: a mean weighted by 4, then divided by 4 again.
    np.testing.assert_allclose(summed["grads"][0].numpy(), [1.0, -2.0])
    assert summed["grads"][1] is None  # no gradient stays no gradient
    np.testing.assert_allclose(summed["grads"][2].numpy(), [[0.0], [3.0]])  # dense
    np.testing.assert_allclose(float(summed["loss"]), 0.5)
    assert summed["examples"].dtype == tf.int32 and int(summed["examples"]) == 4
    np.testing.assert_allclose(summed["extras"][0].numpy(), [7.0])


def test_run_names_the_worker_a_collective_waited_for():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nobody listens there
    workers = Workers(Cluster(["127.0.0.1:1", f"127.0.0.1:{port}"], index=0), "/cpu:0")

    def times_out():
        raise tf.errors.DeadlineExceededError(None, None, "Collective has timed out")

    with pytest.raises(WorkerLostError, match=f"cannot reach worker 1 .*{port}"):
        workers.run(times_out)
    with pytest.raises(ValueError, match="not a collective"):
        workers.run(lambda: (_ for _ in ()).throw(ValueError("not a collective")))


def test_start_together_gives_every_worker_the_chiefs_values():
    workers = alone()
    var = keras.Variable([1.0, 2.0], name="w")  # start_together reads its path
    workers.start_together([var])  # the chief, alone: its values stay
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0])


def test_agree_gives_every_worker_the_chiefs_value():
    assert alone().agree(2**40 + 3) == 2**40 + 3  # the chief, alone: its own


# Each worker draws another seed (keras.utils.set_random_seed(its index)); fit's
# shuffle of arrays must take the chief's on both.
SHUFFLING_WORKER = """
import os, sys
import towers
devices = towers.virtual_devices(1)
cluster = towers.Cluster.from_tf_config().start()
import keras, numpy as np
import towers.training.loop
keras.utils.set_random_seed(cluster.index)
chosen = towers.training.loop.shuffle_seed
def said(*args):
    seed = chosen(*args)
    print("seed", seed, flush=True)
    return seed
towers.training.loop.shuffle_seed = said
engine = towers.Towers(
    lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
    "mse", keras.optimizers.SGD(0.1), devices=devices, cluster=cluster,
)
x = np.arange(16, dtype="float32").reshape(8, 2)
engine.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
"""


def test_fit_shuffles_arrays_in_the_chiefs_order_on_every_worker():
    job = subprocess.run(
        [sys.executable, "-m", "towers.cli", "launch", "--workers", "2", "--",
         sys.executable, "-c", SHUFFLING_WORKER],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    seeds = {
        line.split()[1]: line.split()[3]
        for line in job.stdout.splitlines()
        if line.split()[2:3] == ["seed"]
    }
    assert sorted(seeds) == ["0]", "1]"] and len(set(seeds.values())) == 1, seeds

"""Multi-worker jobs with real processes on loopback (tests/scripts/cluster_train.py).

Each job ends by itself: the collectives carry timeouts, ``towers launch`` stops
the rest when one worker fails, and every subprocess has a timeout here too.
"""

import time

import numpy as np
import pytest

from tests.cluster_jobs import (
    assert_same_as,
    launch,
    reference,
    result,
    weights,
)
from tests.tolerances import MIXED_FLOAT16_RTOL


def test_two_workers_of_two_towers_train_as_one_process_of_four(tmp_path):
    ref = reference(tmp_path / "ref")
    job = launch(tmp_path / "job")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = tmp_path / "job"
    # Uneven batches (13, 7, 1, 10, 33): in the batch of 1, worker 1 has nothing.
    assert_same_as(ref, out)
    expected, got = result(ref, 0), [result(out, r) for r in (0, 1)]
    for worker in got:
        assert worker["steps"] == expected["steps"] == 5
        np.testing.assert_allclose(worker["losses"], expected["losses"], rtol=1e-6)
        # Metrics and evaluation are the cluster's, on every worker.
        assert worker["acc"] == expected["acc"]
        assert worker["evaluate"]["acc"] == expected["evaluate"]["acc"]
        np.testing.assert_allclose(
            worker["evaluate"]["loss"], expected["evaluate"]["loss"], rtol=1e-6
        )


def test_workers_that_build_different_models_stop_with_the_difference(tmp_path):
    started = time.monotonic()
    job = launch(tmp_path / "job", "--model", "wider", "--timeout", "20")
    output = job.stdout + job.stderr
    assert job.returncode != 0
    assert "the workers must build the same model; received" in output
    assert "(8, 5) on worker 1 where worker 0 has" in output or (
        "(8, 4) on worker 0 where worker 1 has" in output
    )
    # Compared before anything else is exchanged: no timeout was waited for.
    assert time.monotonic() - started < 60


def test_explaining_a_step_inside_a_cluster_reports_every_worker(tmp_path):
    job = launch(tmp_path / "job", "--mode", "explain")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    for rank in (0, 1):
        worker = result(tmp_path / "job", rank)
        report = worker["explain"]
        assert report["workers"] == 2
        assert "across workers" in report["stages"]
        assert report["collective_kinds"] == ["all-reduce"]
        assert "workers:         2; this is one worker's step" in report["text"]
        # The step ran, then every variable it touched was put back.
        assert worker["changed_by_explain"] == 0.0
        assert worker["steps"] == 1


@pytest.mark.parametrize("per_execution", [1, 4], ids=["step", "4 steps a call"])
def test_fit_in_a_cluster_reports_the_clusters_history(tmp_path, per_execution):
    # With steps_per_execution, the workers' sums run inside a loop in the graph.
    args = ["--mode", "fit", "--optimizer", "sgd"]
    args += ["--steps-per-execution", str(per_execution)]
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(ref, tmp_path / "job")
    expected = result(ref, 0)["history"]
    for rank in (0, 1):
        history = result(tmp_path / "job", rank)["history"]
        assert history.keys() == expected.keys()
        for name in expected:
            np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)


# The update policies on the cluster's summed gradients. --nan-in 3 puts a NaN in
# global batch 3 inside the last worker's share only: the chief must still see a
# non-finite sum and skip (or raise, or lower its loss scale) with the others.
UPDATE_POLICIES = {
    "accumulate": ["--accumulate", "2"],
    "skip": ["--nonfinite", "skip", "--nan-in", "3"],
    "raise": ["--nonfinite", "raise", "--nan-in", "3"],
    "mixed_float16": ["--policy", "mixed_float16", "--nan-in", "3"],
}


@pytest.mark.parametrize("policy", sorted(UPDATE_POLICIES))
def test_update_policies_in_a_cluster_match_one_process(tmp_path, policy):
    args = UPDATE_POLICIES[policy]
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = tmp_path / "job"
    expected = result(ref, 0)
    if policy == "mixed_float16":
        # 16-bit sums within the towers (tests/tolerances.py): compare each
        # variable's total change, relative to its size, as test_mixed_precision.
        changes = zip(weights(ref, 0, "start"), weights(out, 0), weights(ref, 0))
        for w0, mine, theirs in changes:
            error = np.linalg.norm((mine - w0) - (theirs - w0))
            assert error <= MIXED_FLOAT16_RTOL * np.linalg.norm(theirs - w0)
        for w0, w1 in zip(weights(out, 0), weights(out, 1)):
            np.testing.assert_array_equal(w0, w1)
    else:
        assert_same_as(ref, out)
    for rank in (0, 1):
        got = result(out, rank)
        # The same steps applied, skipped or refused as the one process.
        assert got["iterations"] == expected["iterations"]
        assert got["errors"] == expected["errors"]
        assert got.get("scale") == expected.get("scale")
        rtol = MIXED_FLOAT16_RTOL if policy == "mixed_float16" else 1e-6
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=rtol)
    accumulated = {"accumulate": 2, "skip": 4, "raise": 4, "mixed_float16": 4}
    assert expected["iterations"] == accumulated[policy]
    if policy == "raise":
        assert expected["errors"] and "is not finite" in expected["errors"][0]
    if policy == "mixed_float16":
        assert expected["scale"] == 2.0**14  # halved once, by the NaN step


@pytest.mark.parametrize(
    "args",
    [["--weighted"], ["--outputs", "2", "--weighted"]],
    ids=["sample-weights", "two-outputs-weighted"],
)
def test_what_keras_users_bring_trains_in_a_cluster_as_one_process(tmp_path, args):
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    out = tmp_path / "job"
    assert_same_as(ref, out)
    expected = result(ref, 0)
    for rank in (0, 1):
        got = result(out, rank)
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        np.testing.assert_allclose(
            got["evaluate"]["loss"], expected["evaluate"]["loss"], rtol=1e-5
        )


@pytest.mark.parametrize(
    "jit", [[], ["--jit-compile"], ["--in-turns"]], ids=["", "xla", "turns"]
)
def test_a_batch_normalization_model_trains_in_a_cluster_as_one_process(tmp_path, jit):
    # Global batch statistics summed over the workers' collective runtime: every
    # BatchNormalization layer normalises with the whole global batch's, worker 1
    # joining with nothing in the batch of one. With XLA, between each tower's
    # XLA computations (towers/step/run/phases.py); the reference runs without.
    # In turns: the lockstep a pass that cannot be cut falls back to, its
    # backward sums weighted by each worker's examples.
    args = ["--model", "bn", "--batch-statistics", "global", "--optimizer", "sgd"]
    ref = reference(tmp_path / "ref", *args)
    job = launch(tmp_path / "job", *args, *jit)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    # Weights and the moving mean and variance (model.variables) are one
    # process's, and the same on both workers.
    assert_same_as(ref, tmp_path / "job")
    assert len(weights(ref, 0)) == 7  # kernel; gamma, beta, moving x2; kernel, bias
    assert result(tmp_path / "job", 0)["steps"] == result(ref, 0)["steps"]


def as_one_tower(tmp_path, model, *more):
    """``--model model`` (and ``more`` arguments) with SGD on 2 workers of 2
    towers and on one tower in one process: their weights compared
    (assert_same_as); the reference's result and each worker's."""
    args = ["--model", model, "--optimizer", "sgd", *more]
    ref = reference(tmp_path / "ref", *args, towers=1)
    job = launch(tmp_path / "job", *args)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_as(ref, tmp_path / "job")
    return result(ref, 0), [result(tmp_path / "job", rank) for rank in (0, 1)]


def test_a_clip_dual_encoder_trains_in_a_cluster_as_one_device(tmp_path):
    # Its compute_loss is a softmax over the whole batch's similarities: every
    # worker's outputs are gathered through the collective runtime
    # (towers/step/rules/whole_batch.py), worker 1 joining with nothing in the batch of
    # one; its own Sum metric counts each batch once. The reference is one
    # tower in one process.
    expected, results = as_one_tower(tmp_path, "clip")
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        for key, value in expected["evaluate"].items():
            np.testing.assert_allclose(got["evaluate"][key], value, rtol=1e-5)


def test_a_models_own_train_step_trains_in_a_cluster_as_one_device(tmp_path):
    # Its train_step applies twice, with two optimizers, the second through
    # the first's update, from a loss that sums over the examples plus a
    # weight penalty (found by the probe, towers/step/rules/loss_kinds.py, on each
    # worker): at each apply the towers' gradients are combined,
    # then summed over the workers weighted by their examples, and applied on
    # every worker; the metrics it updates are summed over the workers. What
    # it assigns moves once: an EMA (the same on every tower), a count of
    # examples (aggregation "sum") and a mean prediction ("mean", weighted by
    # the global shares), among the weights compared. Its Dropout layer draws
    # one device's masks, its seed state assigned once, as the others; its
    # input noise, drawn over two blocks of the rows, takes each worker's
    # rows of each block of the global batch's draw (its rows from the one
    # small sum that places them).
    # Worker 1 has nothing in the batch of one. The reference: one tower.
    expected, results = as_one_tower(tmp_path, "twoapplies")
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        np.testing.assert_allclose(got["acc"], expected["acc"], rtol=1e-6)
        for key, value in expected["evaluate"].items():
            np.testing.assert_allclose(got["evaluate"][key], value, rtol=1e-5)


def test_towers_gather_in_a_models_own_step_trains_in_a_cluster_as_one_device(
    tmp_path,
):
    # Its loss is over the whole batch's similarity matrix: towers.gather
    # hands it every tower's and every worker's rows (through the collective
    # runtime), each tower's rows' gradient divided by its share of the
    # global batch, the temperature the loss reads counted once. Worker 1
    # has nothing in the batch of one. The reference: one tower.
    expected, results = as_one_tower(tmp_path, "gathering")
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        np.testing.assert_allclose(
            got["evaluate"]["loss"], expected["evaluate"]["loss"], rtol=1e-5
        )


def test_a_models_own_step_with_batchnorm_trains_in_a_cluster_as_one_device(
    tmp_path,
):
    # The same step with a BatchNormalization layer it runs twice a step, under
    # global batch statistics: each call's moments are summed over the towers
    # and the workers, and the first tower of each worker moves the moving
    # statistics at once; in the backward pass each worker's (and tower's)
    # upstream gradient is weighted by its examples. The reference: one tower.
    expected, results = as_one_tower(
        tmp_path, "twoapplies_bn", "--batch-statistics", "global"
    )
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)


def test_random_draws_in_a_cluster_are_one_devices(tmp_path):
    # Dropout, GaussianNoise and noise over two blocks of the rows: each
    # worker's towers draw their rows of the global batch's numbers, after the
    # rows of the workers before it (one small sum a step, which gives the
    # global batch's rows too); worker 1 has nothing in the batch of one. The
    # reference: one tower on the whole batches.
    expected, results = as_one_tower(tmp_path, "dropout")
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)


def test_a_global_generators_draw_in_a_models_own_step_is_refused_in_a_cluster(
    tmp_path,
):
    # Its own train_step, run in each tower's thread, draws a value per
    # example with seed=None from a model holding no seed generator: no
    # worker can place its rows, so every worker would draw the same. The
    # towers' threads must see the step's cluster as the caller does.
    job = launch(tmp_path / "job", "--model", "unseeded", "--timeout", "20")
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    assert "keras.random.normal with seed=None draws from Keras' global" in output


def test_a_mixture_of_experts_trains_in_a_cluster_as_one_device(tmp_path):
    # keras_hub's Mixtral block adds a load-balancing loss, a product of two
    # means over the whole batch: its token counts and router probabilities are
    # summed over the towers and the workers' collective runtime
    # (towers/step/rules/coupled.py), worker 1 joining with nothing in the batch of
    # one. The reference is one tower in one process: one device's update.
    expected, results = as_one_tower(tmp_path, "moe")
    for got in results:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)

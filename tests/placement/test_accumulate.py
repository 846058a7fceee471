"""accumulate_steps=k: k steps, one apply, exactly one step on the k batches."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import (
    build_dense_sparse_unused,
    build_mlp,
    dense_sparse_batch,
    regression_batch,
)
from tests.tolerances import ADAM_EPSILON, EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.training.checkpoint import TrainingCheckpoint

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    return keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON)


def make_engine(name, num_towers, accumulate_steps, loss=LOSS, build=None):
    keras.utils.set_random_seed(0)
    return Towers(
        build or build_dense_sparse_unused,
        loss,
        lambda: optimizer(name),
        devices=[f"/cpu:{t}" for t in range(num_towers)],
        accumulate_steps=accumulate_steps,
    )


# Adam runs on the dense model: Keras 3's Adam squares each duplicate slice of a
# sparse gradient separately (see the last test), so on an Embedding its update
# depends on how a gradient is split into slices, while the accumulator sums
# slices densely. SGD, linear in the gradient, covers the sparse model.
CASES = {
    "sgd-sparse": ("sgd", build_dense_sparse_unused, LOSS, dense_sparse_batch),
    "adam-dense": ("adam", build_mlp, "mse", regression_batch),
}


def concat(batches):
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)


def assert_same_state(a, b):
    for mine, theirs in zip(a.model.variables, b.model.variables):
        np.testing.assert_allclose(
            mine.numpy(),
            theirs.numpy(),
            rtol=EQUIVALENCE_RTOL,
            atol=EQUIVALENCE_ATOL,
            err_msg=mine.path,
        )
    assert int(a.optimizer.iterations.numpy()) == int(b.optimizer.iterations.numpy())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "num_towers,sizes",
    [(2, [8, 8, 8]), (3, [5, 2, 9]), (4, [1, 7, 3, 6])],
    ids=["even", "uneven", "four"],
)
def test_k_steps_equal_one_step_on_the_k_batches(case, num_towers, sizes):
    name, build, loss, make_batch = CASES[case]
    rng = np.random.default_rng(3)
    k = len(sizes)
    accumulated = make_engine(name, num_towers, k, loss=loss, build=build)
    whole = make_engine(name, num_towers, 1, loss=loss, build=build)

    for _ in range(2):  # two windows: the second starts from emptied accumulators
        batches = [make_batch(rng, size) for size in sizes]
        for i, (x, y) in enumerate(batches):
            accumulated.train_step(x, y)
            applied = int(accumulated.optimizer.iterations.numpy())
            assert applied == (i == k - 1) + int(whole.optimizer.iterations.numpy())
        whole.train_step(*concat(batches))

    assert_same_state(accumulated, whole)
    assert accumulated.steps_done == 2 * k


def test_sum_loss_accumulates_unweighted():
    rng = np.random.default_rng(4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    accumulated = make_engine("sgd", 2, 3, loss=loss)
    whole = make_engine("sgd", 2, 1, loss=loss)
    batches = [dense_sparse_batch(rng, size) for size in (4, 6, 1)]
    for x, y in batches:
        accumulated.train_step(x, y)
    whole.train_step(*concat(batches))
    assert_same_state(accumulated, whole)


def test_sum_loss_with_regularisers_is_refused():
    def build():
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1)),
            ]
        )

    engine = make_engine(
        "sgd", 2, 2, loss=keras.losses.MeanSquaredError("sum"), build=build
    )
    x = np.ones((4, 3), "float32")
    with pytest.raises(ValueError, match="reduction='sum' and regularisation"):
        engine.train_step(x, np.zeros((4, 2), "float32"))


def test_partial_window_is_applied_on_request_and_at_the_end_of_a_fit_epoch():
    rng = np.random.default_rng(5)
    batches = [regression_batch(rng, 6) for _ in range(5)]
    x, y = concat(batches)
    fitted = make_engine("adam", 3, 3, loss="mse", build=build_mlp)
    whole = make_engine("adam", 3, 1, loss="mse", build=build_mlp)

    fitted.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False)  # 3 + 2
    whole.train_step(*concat(batches[:3]))
    whole.train_step(*concat(batches[3:]))

    assert_same_state(fitted, whole)
    assert int(fitted.update.accumulator.count.numpy()) == 0


def test_checkpoint_inside_a_window_resumes_inside_it(tmp_path):
    rng = np.random.default_rng(6)
    batches = [regression_batch(rng, 5) for _ in range(4)]
    stopped, resumed, straight = (
        make_engine("adam", 2, 4, loss="mse", build=build_mlp) for _ in range(3)
    )

    for x, y in batches[:3]:
        stopped.train_step(x, y)
    TrainingCheckpoint(stopped, str(tmp_path)).save(epoch=0, step=3)
    TrainingCheckpoint(resumed, str(tmp_path)).restore()
    resumed.train_step(*batches[3])
    for x, y in batches:
        straight.train_step(x, y)

    assert int(resumed.optimizer.iterations.numpy()) == 1
    assert_same_state(resumed, straight)


def test_sparse_gradients_accumulate_only_their_rows():
    engine = make_engine("sgd", 2, accumulate_steps=2)
    x, y = dense_sparse_batch(np.random.default_rng(7), 4)
    x["ids"][:] = 3  # every example looks up row 3 only
    engine.train_step(x, y)
    embedding = engine.update.accumulator.read(engine.model.embed.embeddings).numpy()
    touched = np.flatnonzero(np.abs(embedding).sum(axis=1))
    assert touched.tolist() == [3]


def test_accumulate_steps_must_be_a_positive_integer():
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match=f"received {bad!r}"):
            make_engine("sgd", 2, accumulate_steps=bad)


def test_accumulators_live_on_the_variable_device():
    engine = make_engine("sgd", 2, accumulate_steps=2)
    for var in engine.update.accumulator.variables:
        assert tf.DeviceSpec.from_string(var.device).device_index == 0, var.device


def test_keras_adam_squares_duplicate_slices_separately():
    """Why Adam is checked on the dense model: pinned, so a Keras fix shows here."""

    def second_moment(grad):
        var = keras.Variable(np.zeros((3, 2), "float32"))
        adam = keras.optimizers.Adam(0.1)
        adam.apply([grad], [var])
        return adam.variables[-1].numpy()[0, 0]  # v of row 0

    one_row_twice = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([0, 0]), [3, 2])
    dense = second_moment(tf.convert_to_tensor(one_row_twice))
    sparse = second_moment(one_row_twice)
    # v = (1 - beta_2) * g^2: dense g = 2 gives 4e-3; Keras sums 1^2 + 1^2.
    np.testing.assert_allclose([dense, sparse], [4e-3, 2e-3], rtol=1e-6)

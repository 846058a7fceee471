"""The loss as terms that shards add up to exactly (towers/step/work/losses.py).

Each check cuts a batch into uneven shards, adds up the shards' terms and divides
as the step does, and compares with Keras' own value on the whole batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.tolerances import EQUIVALENCE_RTOL
from towers.step.work.losses import StepLoss, over, step_divisors

Y_TRUE = tf.constant([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
Y_PRED = tf.constant([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
# Per-example mean squared error of the rows above: (0+4)/2, (4+0)/2, (4+0)/2.
PER_EXAMPLE_MSE = [2.0, 2.0, 2.0]
SHARDS = [(0, 2), (2, 5), (5, 7)]


def step_value(loss, y_true, y_pred, sample_weight=None, shards=SHARDS):
    """The loss as the step computes it from the shards' terms."""

    def part(a, lo, hi):
        return None if a is None else tf.nest.map_structure(lambda t: cut(t, lo, hi), a)

    per_tower = [
        loss.terms(part(y_true, a, b), part(y_pred, a, b), part(sample_weight, a, b))
        for a, b in shards
    ]
    divisors = step_divisors(per_tower)
    total = 0.0
    for o, divisor in enumerate(divisors):
        summed = tf.add_n([terms[o].total for terms in per_tower])
        total += per_tower[0][o].weight * float(over(summed, divisor))
    return total


def cut(tensor, lo, hi):
    """Rows lo..hi of a tensor, with its rows of a Keras mask if it has one (as a
    tower's own forward pass would give it)."""
    rows = tensor[lo:hi]
    mask = getattr(tensor, "_keras_mask", None)
    if mask is not None:
        rows = tf.identity(rows)
        rows._keras_mask = mask[lo:hi]
    return rows


def batch(seed=0, examples=7):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((examples, 3)).astype("float32")
    p = rng.standard_normal((examples, 3)).astype("float32")
    weights = rng.random(examples).astype("float32")
    return y, p, weights


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"]
)
@pytest.mark.parametrize("weighted", [False, True])
def test_shards_add_up_to_keras_full_batch_value(reduction, weighted):
    y, p, weights = batch()
    keras_loss = keras.losses.MeanSquaredError(reduction=reduction)
    sample_weight = weights if weighted else None

    mine = step_value(StepLoss(keras_loss), y, p, sample_weight)

    # Check equivalence.
    expected = float(keras_loss(y, p, sample_weight=sample_weight))
    np.testing.assert_allclose(mine, expected, rtol=EQUIVALENCE_RTOL)


def test_zero_weights_in_a_whole_shard_add_nothing():
    y, p, weights = batch()
    weights[0:2] = 0.0  # the first shard's weights are all zero
    keras_loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")

    mine = step_value(StepLoss(keras_loss), y, p, weights)

    np.testing.assert_allclose(
        mine, float(keras_loss(y, p, sample_weight=weights)), rtol=EQUIVALENCE_RTOL
    )


def masked(values, mask):
    tensor = tf.constant(values)
    tensor._keras_mask = tf.constant(mask)  # as a Masking or Embedding layer sets
    return tensor


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"]
)
def test_a_masked_sequence_loss_matches_keras(reduction):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, (7, 5))
    logits = rng.standard_normal((7, 5, 4)).astype("float32")
    mask = rng.random((7, 5)) > 0.3
    keras_loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction
    )

    mine = step_value(StepLoss(keras_loss), y, masked(logits, mask))

    # Shards cut the masked prediction; each keeps its rows of the mask.
    expected = float(keras_loss(y, masked(logits, mask)))
    np.testing.assert_allclose(mine, expected, rtol=EQUIVALENCE_RTOL)


def test_per_output_losses_and_weights_match_keras_compile_loss():
    y, p, weights = batch(2)
    y2, p2, _ = batch(3)
    losses = {"a": "mse", "b": keras.losses.MeanAbsoluteError()}
    loss_weights = {"a": 1.0, "b": 0.25}
    step_loss = StepLoss(losses, loss_weights)

    mine = step_value(step_loss, {"a": y, "b": y2}, {"a": p, "b": p2}, weights)

    # Check equivalence with Keras' own per-output reduction.
    mse, mae = keras.losses.MeanSquaredError(), keras.losses.MeanAbsoluteError()
    expected = float(mse(y, p, sample_weight=weights)) + 0.25 * float(
        mae(y2, p2, sample_weight=weights)
    )
    np.testing.assert_allclose(mine, expected, rtol=EQUIVALENCE_RTOL)


def test_a_list_loss_follows_the_output_order_and_none_skips_one():
    y, p, _ = batch(4)
    step_loss = StepLoss([None, "mae"], output_names=["first", "second"])

    terms = step_loss.terms([y, y], [p * 0.0, p], None)

    assert [t.name for t in terms] == ["second"]
    np.testing.assert_allclose(
        float(terms[0].total) / terms[0].divisor,
        float(keras.losses.MeanAbsoluteError()(y, p)),
        rtol=EQUIVALENCE_RTOL,
    )


def test_a_loss_dict_naming_an_unknown_output_is_refused():
    step_loss = StepLoss({"a": "mse", "nope": "mae"})

    with pytest.raises(ValueError) as error:
        step_loss.terms({"a": Y_TRUE}, {"a": Y_PRED}, None)
    assert str(error.value) == (
        "loss names outputs the model does not have; received ['nope'], the "
        "model's outputs are ['a']"
    )


def test_per_example_function_is_a_mean_over_examples():
    step_loss = StepLoss(lambda y, p: tf.reduce_sum(tf.square(y - p), axis=-1))

    [term] = step_loss.terms(Y_TRUE, Y_PRED, None)

    assert (float(term.total), term.divisor, term.kind) == (12.0, 3, "mean")


def test_sequence_loss_divides_by_every_timestep():
    # Per-timestep losses: Keras divides by B * timesteps, so the terms do too.
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 4, (5, 3))
    y_pred = tf.constant(rng.standard_normal((5, 3, 4)), tf.float32)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    mine = step_value(StepLoss(keras_loss), y_true, y_pred, shards=[(0, 2), (2, 5)])

    np.testing.assert_allclose(
        mine, float(keras_loss(y_true, y_pred)), rtol=EQUIVALENCE_RTOL
    )


def test_keras_loss_name_is_looked_up():
    [term] = StepLoss("mse").terms(Y_TRUE, Y_PRED, None)

    assert float(term.total) / term.divisor == pytest.approx(np.mean(PER_EXAMPLE_MSE))


def test_user_loss_object_is_not_modified():
    keras_loss = keras.losses.MeanSquaredError(reduction="sum")

    StepLoss(keras_loss).terms(Y_TRUE, Y_PRED, None)

    assert keras_loss.reduction == "sum"


def test_function_returning_two_values_per_example_raises():
    step_loss = StepLoss(lambda y, p: tf.square(y - p))

    with pytest.raises(ValueError, match=r"shape \[3\]; received shape \(3, 2\)"):
        step_loss.terms(Y_TRUE, Y_PRED, None)


def test_unknown_reduction_raises():
    keras_loss = keras.losses.MeanSquaredError()
    keras_loss.reduction = "median"

    with pytest.raises(ValueError, match=r"unsupported loss reduction 'median'"):
        StepLoss(keras_loss)


def test_not_a_loss_raises():
    with pytest.raises(ValueError, match=r"received 42"):
        StepLoss(42)


def test_loss_weights_must_be_numbers():
    with pytest.raises(ValueError, match=r"loss_weights must be numbers; received"):
        StepLoss({"a": "mse"}, loss_weights={"a": "heavy"})

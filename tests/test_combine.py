import numpy as np
import pytest
import tensorflow as tf

from tests.tolerances import EXACT
from towers import combine_gradients


def slices(values, indices, dense_shape):
    return tf.IndexedSlices(
        tf.constant(values, tf.float32),
        tf.constant(indices, tf.int64),
        tf.constant(dense_shape, tf.int64),
    )


def test_mean_and_sum_hand_computed():
    tower_grads = [
        [tf.constant([1.0, 2.0]), tf.constant(4.0)],
        [tf.constant([3.0, 6.0]), tf.constant(0.0)],
        [tf.constant([5.0, 1.0]), tf.constant(2.0)],
    ]

    mean = combine_gradients(tower_grads, reduction="mean")
    total = combine_gradients(tower_grads, reduction="sum")

    np.testing.assert_allclose(mean[0].numpy(), [3.0, 3.0], rtol=EXACT)
    np.testing.assert_allclose(mean[1].numpy(), 2.0, rtol=EXACT)
    np.testing.assert_allclose(total[0].numpy(), [9.0, 9.0], rtol=EXACT)
    np.testing.assert_allclose(total[1].numpy(), 6.0, rtol=EXACT)


def test_weights_scale_each_tower_and_mean_divides_by_their_sum():
    tower_grads = [[tf.constant([2.0])], [tf.constant([8.0])]]

    (total,) = combine_gradients(tower_grads, reduction="sum", weights=[3, 1])
    (mean,) = combine_gradients(tower_grads, reduction="mean", weights=[3, 1])

    np.testing.assert_allclose(total.numpy(), [14.0], rtol=EXACT)  # 3*2 + 1*8
    np.testing.assert_allclose(mean.numpy(), [3.5], rtol=EXACT)  # 14 / 4


@pytest.mark.parametrize("tensor_weights", [False, True])
def test_float64_gradients_keep_their_digits_under_fractional_weights(tensor_weights):
    # A share such as 1/3 is not exact in float32: made float32 on the way it
    # would move a float64 result by about 1e-8 of its size.
    shares = [1 / 3, 2 / 3]
    weights = [tf.constant(w, tf.float64) for w in shares] if tensor_weights else shares
    grads = [
        [tf.constant([3.0, 1.0], tf.float64)],
        [tf.constant([6.0, 1.0], tf.float64)],
    ]

    (total,) = combine_gradients(grads, reduction="sum", weights=weights)
    (mean,) = combine_gradients(grads, reduction="mean", weights=weights)

    assert total.dtype == tf.float64
    want = np.array([3.0, 1.0]) * (1 / 3) + np.array([6.0, 1.0]) * (2 / 3)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-15, atol=0)
    np.testing.assert_allclose(mean.numpy(), want / (1 / 3 + 2 / 3), rtol=1e-15, atol=0)


def test_none_everywhere_stays_none_and_none_somewhere_counts_as_zero():
    tower_grads = [
        [None, tf.constant([2.0]), None],
        [None, None, tf.constant([4.0])],
    ]

    unused, first_only, second_only = combine_gradients(tower_grads, reduction="mean")

    assert unused is None
    # Divided by T=2 towers: the missing tower is a zero, not dropped.
    np.testing.assert_allclose(first_only.numpy(), [1.0], rtol=EXACT)
    np.testing.assert_allclose(second_only.numpy(), [2.0], rtol=EXACT)


def test_indexed_slices_are_combined_as_slices_not_densified():
    tower_grads = [
        [slices([[1.0, 1.0]], [2], [5, 2])],
        [slices([[2.0, 4.0], [6.0, 8.0]], [2, 0], [5, 2])],
    ]

    (combined,) = combine_gradients(tower_grads, reduction="mean")

    assert isinstance(combined, tf.IndexedSlices)
    np.testing.assert_array_equal(combined.indices.numpy(), [2, 2, 0])
    np.testing.assert_allclose(
        combined.values.numpy(), [[0.5, 0.5], [1.0, 2.0], [3.0, 4.0]], rtol=EXACT
    )
    expected_dense = np.zeros((5, 2))
    expected_dense[2] = [1.5, 2.5]
    expected_dense[0] = [3.0, 4.0]
    np.testing.assert_allclose(tf.convert_to_tensor(combined), expected_dense)


def test_indexed_slices_with_none_in_one_tower():
    tower_grads = [[slices([[2.0]], [1], [3, 1])], [None]]

    (combined,) = combine_gradients(tower_grads, reduction="mean")

    assert isinstance(combined, tf.IndexedSlices)
    np.testing.assert_allclose(combined.values.numpy(), [[1.0]], rtol=EXACT)


def test_slices_mixed_with_dense_combine_dense():
    tower_grads = [[slices([[2.0]], [1], [3, 1])], [tf.ones((3, 1))]]

    (combined,) = combine_gradients(tower_grads, reduction="sum")

    np.testing.assert_allclose(combined.numpy(), [[1.0], [3.0], [1.0]], rtol=EXACT)


def test_pairs_in_pairs_out_with_tower_zero_variable():
    kernel, bias = tf.Variable([1.0, 1.0], name="kernel"), tf.Variable(0.0, name="bias")
    tower_grads = [
        [(tf.constant([1.0, 3.0]), kernel), (None, bias)],
        [(tf.constant([3.0, 5.0]), kernel), (tf.constant(2.0), bias)],
    ]

    combined = combine_gradients(tower_grads, reduction="mean")

    assert [
        var is expected for (_, var), expected in zip(combined, [kernel, bias])
    ] == [
        True,
        True,
    ]
    np.testing.assert_allclose(combined[0][0].numpy(), [2.0, 4.0], rtol=EXACT)
    np.testing.assert_allclose(combined[1][0].numpy(), 1.0, rtol=EXACT)


def test_pairs_in_different_variable_order_raise_naming_both():
    a, b = tf.Variable([0.0], name="a"), tf.Variable([0.0], name="b")
    g = tf.constant([1.0])

    with pytest.raises(ValueError, match=r"tower 1 lists variable 'b:0' at position 0"):
        combine_gradients([[(g, a), (g, b)], [(g, b), (g, a)]])


def test_same_inputs_give_the_same_bits():
    rng = np.random.default_rng(0)
    tower_grads = [
        [tf.constant(rng.standard_normal((64, 33)), tf.float32)] for _ in range(5)
    ]

    first = combine_gradients(tower_grads, reduction="mean")[0].numpy()
    second = combine_gradients(tower_grads, reduction="mean")[0].numpy()

    assert first.tobytes() == second.tobytes()


def test_combines_inside_a_tf_function():
    @tf.function
    def combine(a, b):
        return combine_gradients([[a], [b]], reduction="sum")[0]

    np.testing.assert_allclose(
        combine(tf.constant([1.0]), tf.constant([2.0])).numpy(), [3.0], rtol=EXACT
    )


def test_different_lengths_name_the_tower():
    with pytest.raises(ValueError, match=r"tower 1 has 1 gradients but tower 0 has 2"):
        combine_gradients([[tf.ones(1), tf.ones(1)], [tf.ones(1)]])


def test_different_shapes_name_tower_and_variable():
    with pytest.raises(ValueError, match=r"tower 2 variable 1: gradient shape \(3,\)"):
        combine_gradients(
            [
                [tf.ones(1), tf.ones(2)],
                [tf.ones(1), tf.ones(2)],
                [tf.ones(1), tf.ones(3)],
            ]
        )


def test_different_dtypes_name_tower_and_variable():
    with pytest.raises(ValueError, match=r"tower 1 variable 0: gradient dtype float16"):
        combine_gradients([[tf.ones(2)], [tf.ones(2, tf.float16)]])


def test_unknown_reduction_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"one of \['mean', 'sum'\]; received 'avg'"):
        combine_gradients([[tf.ones(1)]], reduction="avg")


def test_wrong_number_of_weights_raises():
    with pytest.raises(ValueError, match=r"one entry per tower \(2\); received 3"):
        combine_gradients([[tf.ones(1)], [tf.ones(1)]], weights=[1, 1, 1])


def test_negative_or_all_zero_weights_raise():
    with pytest.raises(ValueError, match=r"non-negative; received \[1, -1\]"):
        combine_gradients([[tf.ones(1)], [tf.ones(1)]], weights=[1, -1])
    with pytest.raises(ValueError, match=r"positive sum; received \[0, 0\]"):
        combine_gradients(
            [[tf.ones(1)], [tf.ones(1)]], reduction="mean", weights=[0, 0]
        )


def test_no_towers_raises():
    with pytest.raises(ValueError, match=r"at least one tower; received \[\]"):
        combine_gradients([])

import numpy as np
import pytest
import tensorflow as tf

from towers.split import batch_size_of, split_batch, split_sizes


@pytest.mark.parametrize(
    "batch, towers, expected",
    [
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [3, 3, 2, 2]),
        (7, 3, [3, 2, 2]),
        (3, 8, [1, 1, 1, 0, 0, 0, 0, 0]),
        (1, 1, [1]),
        (0, 2, [0, 0]),
    ],
)
def test_split_sizes_hand_computed(batch, towers, expected):
    assert split_sizes(batch, towers) == expected


@pytest.mark.parametrize("batch", range(1, 20))
@pytest.mark.parametrize("towers", [1, 2, 3, 4, 8])
def test_split_batch_shards_concatenate_back_for_every_batch_size(batch, towers):
    x = tf.reshape(tf.range(batch * 3, dtype=tf.float32), (batch, 3))

    shards = split_batch(x, towers)

    sizes = [int(s.shape[0]) for s in shards]
    assert len(shards) == towers
    assert max(sizes) - min(sizes) <= 1
    np.testing.assert_array_equal(tf.concat(shards, 0).numpy(), x.numpy())


def test_split_batch_keeps_the_nest_structure():
    batch = {"image": np.ones((5, 2, 2)), "meta": (np.arange(5), np.arange(5) * 2.0)}

    shards = split_batch(batch, 2)

    assert [set(s) for s in shards] == [{"image", "meta"}] * 2
    assert shards[0]["image"].shape == (3, 2, 2)
    np.testing.assert_array_equal(shards[1]["meta"][0], [3, 4])
    np.testing.assert_array_equal(shards[1]["meta"][1], [6.0, 8.0])


def test_split_batch_numpy_stays_numpy_and_tensors_stay_tensors():
    shards = split_batch((np.arange(4), tf.range(4)), 2)

    assert isinstance(shards[0][0], np.ndarray)
    assert isinstance(shards[0][1], tf.Tensor)


def test_split_batch_with_unknown_batch_size_in_a_function():
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def shard_rows(x):
        return [tf.shape(s)[0] for s in split_batch(x, 4)]

    rows = shard_rows(tf.zeros((6, 2)))

    assert [int(r) for r in rows] == [2, 2, 1, 1]


def test_split_batch_fewer_examples_than_towers_gives_empty_shards():
    shards = split_batch(tf.constant([[1.0], [2.0]]), 4)

    assert [s.shape[0] for s in shards] == [1, 1, 0, 0]


def test_parts_of_other_rows_are_split_in_the_same_shares():
    # 12 and 4 rows: 4 units of 3 and 1 rows; 3 towers take 2, 1 and 1 units.
    shards = split_batch((np.arange(12), {"labeled": np.arange(4) * 10}), 3)

    assert [s[0].tolist() for s in shards] == [
        [0, 1, 2, 3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
    ]
    assert [s[1]["labeled"].tolist() for s in shards] == [[0, 10], [20], [30]]


def test_parts_whose_rows_share_no_divisor_go_to_one_tower():
    # 4 and 3 rows: one unit, so no tower's share of one part differs from
    # its share of the other.
    shards = split_batch((np.zeros((4, 1)), np.zeros((3,))), 2)

    assert [(a.shape[0], b.shape[0]) for a, b in shards] == [(4, 3), (0, 0)]


def test_parts_of_other_rows_split_alike_when_only_the_run_knows_them():
    @tf.function(input_signature=[tf.TensorSpec([None]), tf.TensorSpec([None])])
    def rows(a, b):
        return [tf.shape(leaf)[0] for shard in split_batch((a, b), 2) for leaf in shard]

    counts = rows(tf.range(10.0), tf.range(4.0))

    assert [int(n) for n in counts] == [5, 2, 5, 2]


def test_split_batch_empty_batch_raises():
    with pytest.raises(ValueError, match=r"at least one example; received 0"):
        split_batch(np.zeros((0, 3)), 2)


def test_split_batch_scalar_leaf_raises():
    with pytest.raises(
        ValueError, match=r"batch \(first\) dimension; received a scalar"
    ):
        split_batch((np.zeros((4,)), np.float32(1.0)), 2)


@pytest.mark.parametrize("bad", [0, -2, 1.5, None])
def test_split_batch_bad_tower_count_raises(bad):
    with pytest.raises(ValueError, match=r"num_towers must be a positive int"):
        split_batch(np.zeros((4,)), bad)


def test_batch_size_of_reads_static_size():
    assert batch_size_of({"a": tf.zeros((6, 1)), "b": np.zeros(6)}) == 6

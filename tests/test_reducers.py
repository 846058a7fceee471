"""Reducers: every one sums like per-tensor (cast: within its rounding)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import build_dense_sparse_unused, dense_sparse_batch
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers, combine_gradients
from towers.reducers import Cast, Packed, PerTensor, Sharded, buckets, get_reducer

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,), (11, 4)]  # 15 + 7 + 12 + 1 + 44 floats


def tower_grads(num_towers, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [
        [
            tf.constant(rng.standard_normal(shape).astype("float32") * scale)
            for shape in SHAPES
        ]
        for _ in range(num_towers)
    ]


EXACT_REDUCERS = {
    "packed, one bucket": Packed(),
    "packed, 64-byte buckets": Packed(bytes_per_pack=64),
    "sharded, one bucket": Sharded(),
    "sharded, 100-byte buckets": Sharded(bytes_per_pack=100),
}


@pytest.mark.parametrize("name", sorted(EXACT_REDUCERS))
@pytest.mark.parametrize("num_towers", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reducer_gives_the_same_bits_as_per_tensor(name, num_towers, reduction):
    grads = tower_grads(num_towers)
    reference = combine_gradients(grads, reduction, reducer=PerTensor())
    combined = combine_gradients(grads, reduction, reducer=EXACT_REDUCERS[name])
    for ref, got, shape in zip(reference, combined, SHAPES):
        assert got.shape == shape
        # Same additions in the same tower order: identical float32 results.
        np.testing.assert_array_equal(got.numpy(), ref.numpy())


@pytest.mark.parametrize(
    "dtype,unit", [("bfloat16", 2.0**-8), ("float16", 2.0**-11)], ids=["bf16", "fp16"]
)
@pytest.mark.parametrize("inner", [PerTensor(), Packed(64), Sharded()], ids=str)
def test_cast_is_within_one_rounding_per_tower(dtype, unit, inner):
    grads = tower_grads(4, scale=10.0)
    exact = combine_gradients(grads, "sum")
    cast = combine_gradients(grads, "sum", reducer=Cast(dtype, inner))
    for v, (want, got) in enumerate(zip(exact, cast)):
        assert got.dtype == tf.float32  # summed in float32
        # Each tower's value is rounded once, to nearest: off by at most the unit
        # roundoff 2^-p of it (p: significand bits, 8 for bf16, 11 for fp16).
        bound = unit * np.sum([np.abs(g[v].numpy()) for g in grads], axis=0)
        assert np.all(np.abs(got.numpy() - want.numpy()) <= bound + 1e-6), v
    # And the cast really happened: bf16/fp16 rounding changed something.
    assert any(not np.array_equal(a.numpy(), b.numpy()) for a, b in zip(exact, cast))


@pytest.mark.parametrize("reducer", ["packed", "sharded", "bf16+packed"])
def test_slices_and_none_pass_by_the_reducer(reducer):
    dense = tf.constant([[1.0, 2.0]])
    slices = tf.IndexedSlices(
        tf.constant([[1.0, 1.0]]), tf.constant([2]), tf.constant([4, 2])
    )
    grads = [[dense, slices, None, dense], [dense, slices, None, None]]

    combined = combine_gradients(grads, "sum", reducer=reducer)

    assert isinstance(combined[1], tf.IndexedSlices)
    assert combined[1].indices.numpy().tolist() == [2, 2]
    assert combined[2] is None
    np.testing.assert_array_equal(combined[0].numpy(), [[2.0, 4.0]])
    np.testing.assert_array_equal(combined[3].numpy(), [[1.0, 2.0]])  # one tower


def test_buckets_follow_list_order_dtype_and_the_byte_cap():
    def grads(shape, dtype):
        return [tf.zeros(shape, dtype)]

    per_var = [
        grads((4,), tf.float32),  # 16 bytes
        grads((4,), tf.float32),  # 16
        grads((2,), tf.float16),  # 4: a new dtype starts a bucket
        grads((10,), tf.float32),  # 40: over the cap with anything else
        grads((1,), tf.float32),  # 4
    ]
    assert buckets(per_var, bytes_per_pack=32) == [[0, 1], [2], [3], [4]]


@pytest.mark.parametrize("reducer", ["packed", "sharded"])
def test_packing_and_sharding_run_on_the_tower_devices(reducer):
    devices = ["/cpu:1", "/cpu:2", "/cpu:3"]

    @tf.function
    def combine():
        grads = []
        for device in devices:
            with tf.device(device):
                grads.append([tf.ones((6, 2)) * 2.0, tf.ones((5,))])
        with tf.device("/cpu:0"):
            return combine_gradients(grads, "sum", reducer=reducer)

    graph = combine.get_concrete_function().graph
    ops = {op.type: [] for op in graph.get_operations()}
    for op in graph.get_operations():
        ops[op.type].append(op.device)
    concat_devices = sorted(set(ops["ConcatV2"]))
    add_devices = sorted(set(ops["AddN"]))
    # Each tower packs its own gradients on its device.
    assert {d for d in concat_devices if d.endswith(("CPU:1", "CPU:2", "CPU:3"))}
    if reducer == "sharded":
        # Every tower device sums one slice (reduce-scatter).
        assert [d[-5:] for d in add_devices] == ["CPU:1", "CPU:2", "CPU:3"]
    else:
        assert [d[-5:] for d in add_devices] == ["CPU:0"]
    first, second = combine()
    np.testing.assert_array_equal(first.numpy(), np.full((6, 2), 6.0))
    np.testing.assert_array_equal(second.numpy(), np.full((5,), 3.0))


@pytest.mark.parametrize("reducer", ["packed", "sharded"])
def test_engine_with_a_reducer_trains_like_per_tensor(reducer):
    rng = np.random.default_rng(0)
    batches = [dense_sparse_batch(rng, 10) for _ in range(3)]
    engines = []
    for name in ("per_tensor", reducer):
        keras.utils.set_random_seed(0)
        engine = Towers(
            build_dense_sparse_unused,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            lambda: keras.optimizers.SGD(0.1),
            devices=["/cpu:0", "/cpu:1", "/cpu:2"],
            reducer=name,
        )
        for x, y in batches:
            engine.train_step(x, y)
        engines.append(engine)
    for a, b in zip(engines[0].model.variables, engines[1].model.variables):
        np.testing.assert_allclose(
            a.numpy(), b.numpy(), rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_names_resolve_and_compose():
    assert get_reducer("per_tensor") == PerTensor()
    assert get_reducer("packed") == Packed()
    assert get_reducer("cast") == Cast("bfloat16")
    assert get_reducer("fp16+sharded") == Cast("float16", Sharded())
    packed = Packed(1024)
    assert get_reducer(packed) is packed


@pytest.mark.parametrize("name", ["ring", "bf16+", "fp8+packed", ""])
def test_unknown_reducer_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match=r"received '.*', expected .*'bf16\+packed'"):
        get_reducer(name)


def test_bad_reducer_arguments_name_what_was_received():
    with pytest.raises(ValueError, match="received 0"):
        Packed(bytes_per_pack=0)
    with pytest.raises(ValueError, match="16-bit float dtype.*float32"):
        Cast("float32")
    with pytest.raises(ValueError, match="wraps PerTensor, Packed or Sharded"):
        Cast("bfloat16", inner="packed")


@pytest.mark.parametrize("wire", [None, "bfloat16"])
@pytest.mark.parametrize("inner", [PerTensor, Packed])
def test_fused_sums_equal_add_n_within_float32_rounding(inner, wire):
    rng = np.random.default_rng(7)
    shapes = [(7, 3), (5,), (11, 2)]
    devices = ["/cpu:1", "/cpu:2", "/cpu:3", "/cpu:4"]
    values = [
        [rng.standard_normal(s).astype("float32") for s in shapes] for _ in devices
    ]

    def combine_with(fuse_bytes):
        reducer = inner(fuse_bytes=fuse_bytes)
        reducer = Cast(wire, reducer) if wire else reducer

        @tf.function
        def combine():
            grads = []
            for device, tower in zip(devices, values):
                with tf.device(device):
                    grads.append([tf.constant(v) for v in tower])
            with tf.device("/cpu:0"):
                return combine_gradients(grads, "sum", reducer=reducer)

        graph = combine.get_concrete_function().graph
        calls = [
            op
            for op in graph.get_operations()
            if op.type in ("PartitionedCall", "StatefulPartitionedCall")
            and "fused_sums" in op.get_attr("f").name
        ]
        return [g.numpy() for g in combine()], len(calls)

    fused, fused_calls = combine_with(0)
    plain, plain_calls = combine_with(None)
    assert (fused_calls, plain_calls) == (1, 0)
    # XLA may associate the 4 additions differently from AddN's kernel: each
    # result may differ by a few roundings of the sum's magnitude (~1e-7).
    for got, want in zip(fused, plain):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

"""Reducers: how the towers' dense gradients of each variable are summed.

``combine_gradients`` hands a reducer ``per_var[v][t]``, tower t's (already
weighted) dense gradient of variable v, for the variables every tower has a
gradient for, and gets back one sum per variable. IndexedSlices never reach a
reducer: they are concatenated, not summed. All reducers add towers in tower
order; they differ in what crosses between devices and how many ops it takes:

- ``PerTensor()``: one ``add_n`` per variable, where the caller places it (the
  reference).
- ``Packed(bytes_per_pack)``: each tower flattens and concatenates its gradients,
  on its own device, into buckets of at most ``bytes_per_pack`` (variables in list
  order, one dtype per bucket); one ``add_n`` per bucket; the sums are split back.
  Fewer, larger transfers and reductions.
- ``Sharded(bytes_per_pack)``: packs likewise, then each bucket is cut into T
  slices and tower t's device sums slice t over all towers (reduce-scatter); the
  caller's device concatenates the slices (gather). The summing work is spread
  over the tower devices instead of piling onto one.
- ``Cast(dtype, inner)``: ``inner`` with 16-bit values on the wire: each tower casts
  (after packing, on its device) to ``dtype``; the receiving side casts back and
  sums in the gradient's own dtype. Halves the bytes moved; costs a rounding to
  ``dtype`` per tower gradient (bfloat16: 2^-8 relative, float16: 2^-11).

Names for ``get_reducer``: ``"per_tensor"``, ``"packed"``, ``"sharded"``, and a cast
prefix ``"bf16+"`` / ``"fp16+"`` on any of them (``"bf16+packed"``); ``"cast"``
alone means ``"bf16+per_tensor"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.split import split_sizes

# Packing pays for small tensors (fewer transfers and ops); a tensor of a MiB or
# more gains nothing and costs a copy, so by default it stays a bucket of its own.
# Measured on the 8-tower MLP step (benchmarks/bench_reducers.py): 32 MiB packs
# 1.24x slower than per-tensor, 1 MiB 1.06x.
DEFAULT_BYTES_PER_PACK = 2**20
# fuse_bytes: from this many gradient bytes per tower, the sums run as one
# XLA-compiled function that reads each input once and writes each sum once.
# Off by default: on 4 x 25 M floats it was 1.7x faster than AddN timed alone,
# 1.2x slower timed in alternation with an elementwise pass (allocator state),
# and 2-6 % slower in the 8-tower MLP step, since it waits for every gradient
# before it starts (benchmarks/bench_combine.py, bench_reducers.py).
_WIRE_DTYPES = {"bf16": tf.bfloat16, "fp16": tf.float16}
BASE_NAMES = ("per_tensor", "packed", "sharded")


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One ``add_n`` per variable (the reference reducer).

    Attributes:
      fuse_bytes: from this many gradient bytes per tower, all the sums run as one
        XLA-compiled function; None (the default) never fuses. See the note at
        the top of this module for what it measured.
    """

    wire_dtype: tf.DType | None = None
    fuse_bytes: int | None = None

    def reduce(self, per_var: list[list[tf.Tensor]]) -> list[tf.Tensor]:
        return _sums(per_var, self.wire_dtype, self.fuse_bytes)

    @property
    def name(self) -> str:
        return _cast_prefix(self.wire_dtype) + "per_tensor"


@dataclasses.dataclass(frozen=True)
class Packed:
    """Flatten and concatenate into buckets of ``bytes_per_pack``; one sum each."""

    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK
    wire_dtype: tf.DType | None = None
    fuse_bytes: int | None = None

    def __post_init__(self):
        _check_bytes(self.bytes_per_pack)

    def reduce(self, per_var: list[list[tf.Tensor]]) -> list[tf.Tensor]:
        return _reduce_buckets(per_var, self.bytes_per_pack, self._sum_buckets)

    def _sum_buckets(self, packed: list[list[tf.Tensor]]) -> list[tf.Tensor]:
        return _sums(packed, self.wire_dtype, self.fuse_bytes)

    @property
    def name(self) -> str:
        return _cast_prefix(self.wire_dtype) + "packed"


@dataclasses.dataclass(frozen=True)
class Sharded(Packed):
    """Packed buckets, each reduce-scattered over the towers' devices, gathered."""

    def _sum_buckets(self, packed: list[list[tf.Tensor]]) -> list[tf.Tensor]:
        return [self._sum_bucket(bucket) for bucket in packed]

    def _sum_bucket(self, packed: list[tf.Tensor]) -> tf.Tensor:
        # packed[t]: f32[n] on tower t's device. Slice s is summed on tower s.
        num = len(packed)
        sizes = split_sizes(int(packed[0].shape[0]), num)
        pieces = []
        for tensor in packed:
            with tf.device(tensor.device):
                wire = _to_wire(tensor, self.wire_dtype)
                pieces.append(tf.split(wire, sizes) if num > 1 else [wire])
        slices = []
        for s in range(num):
            with tf.device(packed[s].device):
                slices.append(
                    _add(
                        [_from_wire(pieces[t][s], packed[t].dtype) for t in range(num)]
                    )
                )
        return tf.concat(slices, axis=0) if num > 1 else slices[0]

    @property
    def name(self) -> str:
        return _cast_prefix(self.wire_dtype) + "sharded"


def Cast(dtype: str | tf.DType = "bfloat16", inner: Any = None) -> Any:  # noqa: N802
    """``inner`` (default ``PerTensor()``) with ``dtype`` values on the wire.

    Example:
      >>> Cast("bfloat16", Packed(bytes_per_pack=1024)).name
      'bf16+packed'
    """
    dtype = tf.as_dtype(dtype)
    if dtype not in _WIRE_DTYPES.values():
        raise ValueError(
            f"Cast needs a 16-bit float dtype (bfloat16 or float16); received {dtype!r}"
        )
    inner = PerTensor() if inner is None else inner
    if not hasattr(inner, "wire_dtype"):
        raise ValueError(f"Cast wraps PerTensor, Packed or Sharded; received {inner!r}")
    return dataclasses.replace(inner, wire_dtype=dtype)


def get_reducer(reducer: Any) -> Any:
    """A reducer from a name or an object (objects are returned as they are).

    Raises:
      ValueError: an unknown name; the message lists the valid ones.

    Example:
      >>> get_reducer("bf16+sharded").name, get_reducer("packed").name
      ('bf16+sharded', 'packed')
    """
    if hasattr(reducer, "reduce") and not isinstance(reducer, str):
        return reducer
    if isinstance(reducer, str):
        prefix, _, base = reducer.rpartition("+")
        if reducer == "cast":
            prefix, base = "bf16", "per_tensor"
        bases = {"per_tensor": PerTensor, "packed": Packed, "sharded": Sharded}
        if base in bases and (prefix == "" or prefix in _WIRE_DTYPES):
            made = bases[base]()
            return Cast(_WIRE_DTYPES[prefix], made) if prefix else made
    valid = [*BASE_NAMES, "cast"] + [
        f"{p}+{b}" for p in _WIRE_DTYPES for b in BASE_NAMES
    ]
    raise ValueError(
        f"unknown reducer; received {reducer!r}, expected a reducer object or one of "
        f"{valid}"
    )


def _reduce_buckets(per_var, bytes_per_pack, sum_buckets) -> list[tf.Tensor]:
    """Packs each tower's gradients into buckets, sums them all, unpacks."""
    out: list[Any] = [None] * len(per_var)
    groups = buckets(per_var, bytes_per_pack)
    packed_groups = []
    for bucket in groups:
        num_towers = len(per_var[bucket[0]])
        packed = []
        for t in range(num_towers):
            with tf.device(per_var[bucket[0]][t].device):
                flat = [_flat(per_var[v][t]) for v in bucket]
                packed.append(flat[0] if len(flat) == 1 else tf.concat(flat, 0))
        packed_groups.append(packed)
    for bucket, total in zip(groups, sum_buckets(packed_groups)):
        sizes = [per_var[v][0].shape.num_elements() for v in bucket]
        pieces = tf.split(total, sizes) if len(bucket) > 1 else [total]
        for v, piece in zip(bucket, pieces):
            shape = per_var[v][0].shape
            out[v] = piece if shape.rank == 1 else tf.reshape(piece, shape)
    return out


def _flat(tensor: tf.Tensor) -> tf.Tensor:
    # Every op costs a few microseconds on a host; a vector needs no reshape.
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def buckets(per_var: list[list[tf.Tensor]], bytes_per_pack: int) -> list[list[int]]:
    """Variable indices in list order, cut at dtype changes and at the byte cap.

    A variable larger than the cap gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    size = 0
    for v, grads in enumerate(per_var):
        nbytes = grads[0].shape.num_elements() * grads[0].dtype.size
        same_dtype = buckets and per_var[buckets[-1][0]][0].dtype == grads[0].dtype
        if buckets and same_dtype and size + nbytes <= bytes_per_pack:
            buckets[-1].append(v)
            size += nbytes
        else:
            buckets.append([v])
            size = nbytes
    return buckets


def _sums(
    groups: Sequence[Sequence[tf.Tensor]], wire_dtype, fuse_bytes: int | None
) -> list[tf.Tensor]:
    """Each group's tensors summed in order.

    Each tensor is cast to ``wire_dtype`` on its own device first (that is the
    wire); the sums happen in the groups' own dtype where the caller placed us,
    one AddN per group, or all in one XLA-compiled function from ``fuse_bytes``
    gradient bytes per tower.
    """
    dtypes = tuple(group[0].dtype for group in groups)
    wired = []
    for group in groups:
        wired_group = []
        for tensor in group:
            with tf.device(tensor.device):
                wired_group.append(_to_wire(tensor, wire_dtype))
        wired.append(wired_group)
    if all(len(group) == 1 for group in wired):  # nothing to add
        return [_from_wire(g[0], d) for g, d in zip(wired, dtypes)]
    per_tower = sum(g[0].shape.num_elements() * d.size for g, d in zip(groups, dtypes))
    if fuse_bytes is not None and per_tower >= fuse_bytes:
        return _fused_sums(wired, dtypes)
    return [_add([_from_wire(t, d) for t in g]) for g, d in zip(wired, dtypes)]


@tf.function(jit_compile=True, autograph=False)
def _fused_sums(groups: list[list[tf.Tensor]], dtypes: tuple) -> list[tf.Tensor]:
    # The same additions, which XLA may associate differently from AddN's
    # kernel: deterministic, and within a few float32 roundings of AddN's sums.
    return [
        _add([_from_wire(t, dtype) for t in group])
        for group, dtype in zip(groups, dtypes)
    ]


def _add(tensors: list[tf.Tensor]) -> tf.Tensor:
    return tensors[0] if len(tensors) == 1 else tf.add_n(tensors)


def _to_wire(tensor: tf.Tensor, wire_dtype) -> tf.Tensor:
    return tensor if wire_dtype is None else tf.cast(tensor, wire_dtype)


def _from_wire(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


def _cast_prefix(wire_dtype) -> str:
    names = {v: k for k, v in _WIRE_DTYPES.items()}
    return "" if wire_dtype is None else names[wire_dtype] + "+"


def _check_bytes(bytes_per_pack: Any) -> None:
    if not isinstance(bytes_per_pack, (int, np.integer)) or bytes_per_pack < 1:
        raise ValueError(
            f"bytes_per_pack must be a positive integer; received {bytes_per_pack!r}"
        )

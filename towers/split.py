"""split_batch: cut one global batch into per-tower shards along the first axis.

A batch of B examples goes to T towers in contiguous, ordered shards whose sizes
differ by at most one (the first ``B % T`` towers get one more). When B < T the last
towers get zero examples. Concatenating the shards in tower order gives the batch
back, which is what makes T towers add up to one device on the whole batch.

A batch whose parts differ in rows (a model's own step may take a zip of two
datasets batched apart) is ``g = gcd`` of their rows *units*, each of
``B_p / g`` rows of part p; the rule deals out units, so every part's share of
tower t is the same ``k_t / g``, and every part's shards concatenate back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import tensorflow as tf

# Leaves whose rows are examples but which are not dense tensors.
COMPOSITES = (tf.SparseTensor, tf.RaggedTensor)


def split_sizes(batch_size: int, num_towers: int) -> list[int]:
    """Returns how many examples each tower gets.

    Args:
      batch_size: B, the number of examples in the global batch (B >= 0).
      num_towers: T >= 1.

    Returns:
      T sizes that sum to B and differ by at most one, larger first.

    Example:
      >>> split_sizes(10, 4)
      [3, 3, 2, 2]
      >>> split_sizes(2, 4)
      [1, 1, 0, 0]
    """
    _check_num_towers(num_towers)
    return _part_sizes(int(batch_size), num_towers)


def _part_sizes(size: Any, parts: int) -> Any:
    """The one rule for B examples over N parts (towers, or a cluster's workers):
    contiguous, in order, the first ``B % N`` parts one larger. A list for a
    Python int; an int32 tensor for a B known only when the step runs."""
    base, extra = size // parts, size % parts
    if isinstance(size, int):
        return [base + (1 if t < extra else 0) for t in range(parts)]
    return base + tf.cast(tf.range(parts) < extra, size.dtype)


def units_of(batch: Any) -> tuple[Any, list[Any]]:
    """The batch's units ``g`` (the gcd of its leaves' rows) and each leaf's
    rows (None for a None leaf): ints where every leaf's rows are known, else
    scalar int32 tensors. Leaves of equal rows: ``g = B``, one row each.

    >>> units_of((np.zeros((6, 2)), np.zeros(4), None))
    (2, [6, 4, None])
    """
    rows = [
        None if leaf is None else batch_size_of(leaf) for leaf in tf.nest.flatten(batch)
    ]
    counts = [r for r in rows if r is not None]
    if not counts:
        raise ValueError(f"a batch needs at least one tensor; received {batch!r}")
    if all(isinstance(r, int) for r in counts):
        return math.gcd(*counts), rows
    units = tf.cast(counts[0], tf.int32)
    for r in counts[1:]:  # Euclid's, as the input runs
        pair = (units, tf.cast(r, tf.int32))
        units = tf.while_loop(lambda a, b: b > 0, lambda a, b: (b, a % b), pair)[0]
    return units, rows


def examples_of(batch: Any) -> int | tf.Tensor:
    """The batch's examples, what its shares divide: its first leaf's rows
    (of a batch whose parts differ in rows, its first part's).

    >>> examples_of({"a": np.zeros((6, 2)), "b": np.zeros(4)})
    6
    """
    leaves = [leaf for leaf in tf.nest.flatten(batch) if leaf is not None]
    return batch_size_of(leaves[0] if leaves else batch)


def batch_size_of(batch: Any) -> int | tf.Tensor:
    """The common first dimension of every leaf of ``batch``.

    Returns a Python int when every leaf's first dimension is known, else a scalar
    int32 tensor (inside a ``tf.function`` traced with an unknown batch size).

    Raises:
      ValueError: the batch has no leaves, a leaf is a scalar, or leaves disagree.
    """
    # None stands for a part the batch does not have (no targets, no weights).
    leaves = [leaf for leaf in tf.nest.flatten(batch) if leaf is not None]
    if not leaves:
        raise ValueError(f"a batch needs at least one tensor; received {batch!r}")
    static = []
    for leaf in leaves:
        shape = tf.TensorShape(np.shape(leaf) if _is_array(leaf) else _shape(leaf))
        if shape.rank == 0:
            raise ValueError(
                "every tensor in a batch needs a batch (first) dimension; received "
                f"a scalar of shape {shape}"
            )
        static.append(shape[0] if shape.rank is not None else None)
    known = {s for s in static if s is not None}
    if len(known) > 1:
        raise ValueError(
            "every tensor in a batch must have the same number of examples; received "
            f"first dimensions {static}"
        )
    if len(known) == 1 and None not in static:
        return known.pop()
    return _rows(leaves[0])


def _shape(leaf: Any) -> tf.TensorShape:
    shape = getattr(leaf, "shape", None)
    return tf.TensorShape(np.shape(leaf) if shape is None else shape)


def _rows(leaf: Any) -> tf.Tensor:
    """A leaf's examples, known when the step runs (an int32 scalar)."""
    if isinstance(leaf, tf.SparseTensor):
        return tf.cast(leaf.dense_shape[0], tf.int32)
    if isinstance(leaf, tf.RaggedTensor):
        return tf.cast(leaf.nrows(), tf.int32)
    return tf.shape(leaf, out_type=tf.int32)[0]


def take_rows(leaf: Any, start: Any, stop: Any) -> Any:
    """Examples ``[start, stop)`` of a leaf: an array, a tensor, or a sparse
    or ragged tensor (its rows), keeping its kind.

    >>> sparse = tf.sparse.from_dense([[0, 1], [2, 0], [0, 3]])
    >>> tf.sparse.to_dense(take_rows(sparse, 1, 3)).numpy().tolist()
    [[2, 0], [0, 3]]
    """
    if leaf is None:  # an optional input given none
        return None
    if isinstance(leaf, tf.SparseTensor):
        first, last = tf.cast(start, tf.int64), tf.cast(stop, tf.int64)
        rest = leaf.dense_shape[1:]
        begin = tf.concat([[first], tf.zeros_like(rest)], 0)
        part = tf.sparse.slice(leaf, begin, tf.concat([[last - first], rest], 0))
        # The static shape Keras' layers read: the rows', the rest the leaf's.
        rows = stop - start if isinstance(start + stop, int) else None
        part.set_shape([rows, *leaf.shape[1:]])
        return part
    return leaf[start:stop]


def split_batch(batch: Any, num_towers: int) -> list[Any]:
    """Splits every tensor or array of a nested batch into per-tower shards.

    Args:
      batch: a tensor, a NumPy array, or any nest (tuple, list, dict) of them,
        B >= 1 examples on the first axis; parts of other rows are split in
        the same shares (the module's units); a None in the nest (no targets,
        say) stays None in every shard.
      num_towers: T >= 1.

    Returns:
      A list of T nests with the structure of ``batch``; tower t's leaves hold
      examples ``[offset_t, offset_t + n_t)``. NumPy leaves stay NumPy views.

    Raises:
      ValueError: T < 1, or B == 0.

    Example:
      >>> import numpy as np
      >>> shards = split_batch({"x": np.arange(5), "y": np.arange(5) * 10}, 2)
      >>> [s["x"].tolist() for s in shards], shards[1]["y"].tolist()
      ([[0, 1, 2], [3, 4]], [30, 40])
      >>> parts = split_batch((np.arange(6), np.arange(2)), 2)  # in units of 3 and 1
      >>> [[p.tolist() for p in s] for s in parts]
      [[[0, 1, 2], [0]], [[3, 4, 5], [1]]]
    """
    _check_num_towers(num_towers)
    units, rows = units_of(batch)
    if isinstance(units, int) and units == 0:
        raise ValueError("a batch needs at least one example; received 0")
    shares = _part_sizes(units, num_towers)  # each tower's units
    per_leaf = [
        [None] * num_towers
        if leaf is None
        else _split_leaf(leaf, _rows_of_units(shares, n, units), num_towers)
        for leaf, n in zip(tf.nest.flatten(batch), rows)
    ]
    return [
        tf.nest.pack_sequence_as(batch, [shards[t] for shards in per_leaf])
        for t in range(num_towers)
    ]


def _rows_of_units(shares: Any, rows: Any, units: Any) -> Any:
    """Each tower's rows of a leaf of ``rows`` rows, given its ``units``."""
    if isinstance(shares, list):
        return [k * (rows // units) for k in shares]
    return shares * (tf.cast(rows, tf.int32) // units)


@dataclasses.dataclass
class Shards:
    """One step's batch, cut for its towers.

    Attributes:
      size: B, the step's examples (its first part's rows, ``examples_of``):
        an int, or a scalar tensor when only the run knows it.
      parts: ``parts[t]``, tower t's shard: the batch's structure over its n_t
        examples.
      sizes: ``[n_0, ..., n_{T-1}]`` when B is known at trace time, else None.
    """

    size: Any
    parts: list[Any]
    sizes: list[int] | None

    @property
    def normaliser(self) -> Any:
        """What each tower's loss share divides by: B, or 1 for a worker of a
        cluster whose share of a small batch is empty (its towers add zeros)."""
        if isinstance(self.size, int):
            return max(self.size, 1)
        return tf.maximum(self.size, 1)

    def working(self) -> list[int]:
        """The towers that get examples. With none (an empty share), tower 0
        alone still runs, so the worker joins its cluster's step with zeros.

        Example:
          >>> split_for_towers(np.arange(2), 4).working()
          [0, 1]
          >>> split_for_towers(np.arange(0), 4).working()
          [0]
        """
        if self.sizes is None:  # B unknown when traced: every tower runs
            return list(range(len(self.parts)))
        return [t for t, n in enumerate(self.sizes) if n] or [0]


def split_for_towers(batch: Any, num_towers: int) -> Shards:
    """``split_batch`` for a step: the shards with their sizes. An empty batch
    (only a worker of a cluster gets one) gives every tower the empty batch.

    Example:
      >>> shards = split_for_towers((np.arange(5), np.arange(5)), 2)
      >>> shards.size, shards.sizes, shards.parts[1][0].tolist()
      (5, [3, 2], [3, 4])
    """
    size = examples_of(batch)
    if isinstance(size, int) and size == 0:
        return Shards(0, [batch] * num_towers, [0] * num_towers)
    units = units_of(batch)[0] if isinstance(size, int) else None
    known = isinstance(units, int)  # each tower's first-part rows
    sizes = (
        _rows_of_units(split_sizes(units, num_towers), size, units) if known else None
    )
    if num_towers == 1:  # the whole batch: no split op to run
        return Shards(size, [batch], sizes)
    return Shards(size, split_batch(batch, num_towers), sizes)


def _split_leaf(leaf: Any, sizes: Any, num_towers: int) -> list[Any]:
    if _is_array(leaf):
        bounds = np.cumsum([0, *sizes])
        leaf = np.asarray(leaf)
        return [leaf[bounds[t] : bounds[t + 1]] for t in range(num_towers)]
    if isinstance(leaf, COMPOSITES):
        bounds = (
            [int(b) for b in np.cumsum([0, *sizes])]
            if isinstance(sizes, list)
            else tf.concat([[0], tf.cumsum(sizes)], 0)
        )
        return [take_rows(leaf, bounds[t], bounds[t + 1]) for t in range(num_towers)]
    return tf.split(leaf, sizes, num=num_towers, axis=0)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic))


def _check_num_towers(num_towers: int) -> None:
    if (
        isinstance(num_towers, bool)
        or not isinstance(num_towers, int)
        or num_towers < 1
    ):
        raise ValueError(f"num_towers must be a positive int; received {num_towers!r}")

"""combine_gradients: one gradient per variable from every tower's gradients.

Pure: no optimizer, no variables written, no device chosen (the caller places it).
The shape it takes and returns, in tf_cnn_benchmarks' vocabulary::

    tower_grads = [[g_00, g_01, ..., g_0V],    # tower 0: one entry per variable
                   [g_10, g_11, ..., g_1V],    # tower 1
                   ...]                        # g_tv: Tensor, IndexedSlices or None
      -> [g_0, g_1, ..., g_V]                  # one combined entry per variable

or the same with ``(gradient, variable)`` pairs in place of each ``g_tv`` (the form
the TF1 multi-GPU tutorials used), which returns ``[(g_0, var_0), ...]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import tensorflow as tf

from towers._runtime import called_graph
from towers.reducers import Cast, Packed, PerTensor, Sharded, get_reducer

__all__ = [
    "Cast",
    "Packed",
    "PerTensor",
    "Sharded",
    "combine_gradients",
    "get_reducer",
]

Reduction = Literal["mean", "sum"]
REDUCTIONS = ("mean", "sum")


def combine_gradients(
    tower_grads: Sequence[Sequence[Any]],
    reduction: Reduction = "mean",
    weights: Sequence[float] | None = None,
    reducer: Any = "per_tensor",
) -> list[Any]:
    """Combines per-tower gradients into one gradient per variable.

    Rules:
      * ``"sum"``: ``sum_t w_t * g_tv``; ``"mean"``: that sum divided by ``sum_t w_t``
        (``w_t = 1`` when ``weights`` is None, so the mean divides by T).
      * ``None`` in every tower stays ``None``; ``None`` in some towers counts as
        zero there (it is never dropped by position).
      * IndexedSlices stay slices: values and indices are concatenated in tower
        order and scaled, not densified, as one device's gradient holds an
        index once per use. Where the op sums each index once (its indices
        come from a ``Unique``: ``embedding_lookup_sparse``, a sparse
        ``x`` times a kernel in Keras), the towers' shares of an index are
        summed into one, as the op does on one device (traced graphs; an
        optimizer such as Adagrad squares each slice). A variable whose towers
        mix slices and dense tensors is combined dense.
      * Towers are added in tower order, variables in list order: the same inputs
        give the same bits.

    Args:
      tower_grads: ``tower_grads[t][v]``, gradients or ``(gradient, variable)``
        pairs, one list per tower, the same length for every tower.
      reduction: ``"mean"`` or ``"sum"``.
      weights: optional per-tower weights (numbers or scalar tensors), one per tower.
      reducer: how dense gradients are summed: a name (``"per_tensor"``,
        ``"packed"``, ``"sharded"``, ``"bf16+packed"``, ...) or a reducer object
        (``PerTensor()``, ``Packed(bytes_per_pack)``, ``Sharded()``,
        ``Cast("bfloat16", inner)``); see ``towers/reducers.py``. Variables that
        only some towers have a gradient for are summed per tensor.

    Returns:
      One combined gradient per variable, in the form given (pairs carry tower
      0's variable).

    Raises:
      ValueError: no towers, an unknown reduction or reducer, weights of the wrong
        length, or
        towers that disagree on the number, shape or dtype of gradients (the
        message names the tower and the variable).

    Example:
      >>> import tensorflow as tf
      >>> tower_grads = [[tf.constant([1.0, 2.0]), None],
      ...                [tf.constant([3.0, 6.0]), None]]
      >>> mean, unused = combine_gradients(tower_grads, reduction="mean")
      >>> mean.numpy().tolist(), unused
      ([2.0, 4.0], None)
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {list(REDUCTIONS)}; received {reduction!r}"
        )
    num_towers = len(tower_grads)
    if num_towers == 0:
        raise ValueError("tower_grads must hold at least one tower; received []")
    reducer = get_reducer(reducer)
    as_pairs = _is_pairs(tower_grads[0])
    grads, variables = _unzip(tower_grads, as_pairs)
    scales, divisor = _tower_scales(num_towers, reduction, weights)
    combined: list[Any] = []
    pending: dict[int, list[tf.Tensor]] = {}  # v -> every tower's scaled dense grad
    for v in range(len(grads[0])):
        grads_v = [grads[t][v] for t in range(num_towers)]
        result = _combine_variable(grads_v, scales, _label(v, variables))
        if isinstance(result, list) and len(result) == num_towers:
            pending[v] = result  # summed below, all together, by the reducer
        elif isinstance(result, list):
            result = PerTensor().reduce([result])[0]
        combined.append(result)
    if pending:
        for v, total in zip(pending, reducer.reduce(list(pending.values()))):
            combined[v] = total
    combined = [_divide(g, divisor) for g in combined]
    return list(zip(combined, variables)) if as_pairs else combined


def _is_pairs(tower: Sequence[Any]) -> bool:
    return any(
        isinstance(item, (tuple, list)) and len(item) == 2 and _is_variable(item[1])
        for item in tower
    )


def _is_variable(obj: Any) -> bool:
    return isinstance(obj, tf.Variable) or (
        hasattr(obj, "assign") and hasattr(obj, "shape") and hasattr(obj, "dtype")
    )


def _unzip(tower_grads: Sequence[Sequence[Any]], as_pairs: bool):
    """Returns ``grads[t][v]`` and tower 0's variables (or None)."""
    num_vars = len(tower_grads[0])
    grads, variables = [], None
    for t, tower in enumerate(tower_grads):
        if len(tower) != num_vars:
            raise ValueError(
                f"tower {t} has {len(tower)} gradients but tower 0 has {num_vars}: "
                "every tower must list one gradient per variable, in the same order"
            )
        if as_pairs:
            if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in tower):
                raise ValueError(
                    f"tower {t} mixes (gradient, variable) pairs with bare gradients; "
                    "use one form for every tower"
                )
            grads.append([g for g, _ in tower])
            tower_vars = [var for _, var in tower]
            if variables is None:
                variables = tower_vars
            _check_same_variables(t, tower_vars, variables)
        else:
            grads.append(list(tower))
    return grads, variables


def _check_same_variables(t: int, tower_vars: list, variables: list) -> None:
    for v, (var, first) in enumerate(zip(tower_vars, variables)):
        if var is not first and _var_name(var) != _var_name(first):
            raise ValueError(
                f"tower {t} lists variable {_var_name(var)!r} at position {v} where "
                f"tower 0 lists {_var_name(first)!r}: pairs must be in the same order"
            )


def _var_name(var: Any) -> str:
    return getattr(var, "path", None) or getattr(var, "name", None) or repr(var)


def _label(v: int, variables: list | None) -> str:
    return f"variable {v}" + (f" ({_var_name(variables[v])!r})" if variables else "")


def _tower_scales(num_towers: int, reduction: str, weights):
    """Per-tower multipliers (None: no multiply) and the final divisor (or None)."""
    if weights is None:
        return [None] * num_towers, (num_towers if reduction == "mean" else None)
    weights = list(weights)
    if len(weights) != num_towers:
        raise ValueError(
            f"weights must have one entry per tower ({num_towers}); received "
            f"{len(weights)}: {weights}"
        )
    numbers = [w for w in weights if isinstance(w, (int, float))]
    if any(w < 0 for w in numbers):
        raise ValueError(f"weights must be non-negative; received {weights}")
    if reduction == "sum":
        return weights, None
    if len(numbers) < num_towers:  # some weights are tensors: summed per dtype
        return weights, weights
    if sum(numbers) == 0:
        raise ValueError(f"mean needs weights with a positive sum; received {weights}")
    return weights, sum(numbers)


def _combine_variable(grads_v: list, scales: list, label: str):
    """None, the concatenated slices, or the towers' scaled dense gradients."""
    present = [(t, g) for t, g in enumerate(grads_v) if g is not None]
    if not present:
        return None
    _check_agree(present, label)
    if all(isinstance(g, tf.IndexedSlices) for _, g in present):
        return _combine_slices(present, scales)
    return [_scaled(tf.convert_to_tensor(g), scales[t]) for t, g in present]


def _combine_slices(present: list, scales: list) -> tf.IndexedSlices:
    values = [_scaled(g.values, scales[t]) for t, g in present]
    indices = [tf.cast(g.indices, tf.int64) for _, g in present]
    shape = present[0][1].dense_shape
    if len(values) == 1:
        return tf.IndexedSlices(values[0], indices[0], shape)
    values, indices = tf.concat(values, axis=0), tf.concat(indices, axis=0)
    if all(_once_per_index(g.indices) for _, g in present):
        indices, at = tf.unique(indices)  # first use first: one device's order
        values = tf.math.unsorted_segment_sum(values, at, tf.size(indices))
    return tf.IndexedSlices(values, indices, shape)


# Ops that reshape or relabel a tensor and keep what its elements are.
_SAME_ELEMENTS = {"Identity", "Reshape", "Cast", "ExpandDims", "Squeeze"}


def _once_per_index(indices: Any) -> bool:
    """Whether a traced gradient's indices are a ``Unique``'s output (through
    reshapes, and into the functions that return them): its op summed every
    use of an index into one slice. False where there is no graph (eager)."""
    if tf.executing_eagerly():
        return False
    tensor = indices
    while True:
        op = tensor.op
        if op.type in _SAME_ELEMENTS and op.inputs:
            tensor = op.inputs[0]
            continue
        called = op.type.endswith("PartitionedCall") and called_graph(op.graph, op.name)
        if not called:
            return op.type == "Unique"
        tensor = called.outputs[tensor.value_index]


def _divide(grad: Any, divisor: Any) -> Any:
    """``grad / divisor``; a list divisor is the weights, summed in the
    gradient's own dtype."""
    if grad is None or divisor is None:
        return grad
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    if isinstance(divisor, list):
        total = tf.add_n([in_dtype(w, values.dtype) for w in divisor])
    else:
        total = in_dtype(divisor, values.dtype)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values / total, grad.indices, grad.dense_shape)
    return grad / total


def _scaled(value: tf.Tensor, scale) -> tf.Tensor:
    return value if scale is None else value * in_dtype(scale, value.dtype)


def in_dtype(number: Any, dtype: tf.DType) -> tf.Tensor:
    """``number`` as a tensor of ``dtype``: a Python number becomes a constant
    of that dtype directly (``tf.cast`` would first make it float32 and lose a
    float64 model's digits); a tensor is cast."""
    if isinstance(number, (int, float)):
        return tf.constant(number, dtype)
    return tf.cast(number, dtype)


def _check_agree(present: list, label: str) -> None:
    t0, first = present[0]
    for t, g in present[1:]:
        if g.dtype != first.dtype:
            raise ValueError(
                f"tower {t} {label}: gradient dtype {g.dtype.name} differs from "
                f"tower {t0}'s {first.dtype.name}"
            )
        if not tf.TensorShape(g.shape).is_compatible_with(first.shape):
            raise ValueError(
                f"tower {t} {label}: gradient shape {g.shape} differs from tower "
                f"{t0}'s {first.shape}"
            )

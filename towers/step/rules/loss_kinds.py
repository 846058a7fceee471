"""How a loss depends on its batch, and what the step does with it.

The towers weigh each gradient by their share ``s_t = n_t / B``: one
device's for a mean over the shard's examples. Its terms that read no
example set apart (a weight penalty, ``c``: :func:`batch_free`), a sum is
handed in as a mean's: ``(g - g_c) / s_t + g_c`` (:func:`as_mean`). Which a
loss is, the probe finds; :func:`coupling_layer` says where a forward pass
couples the examples."""

from __future__ import annotations

import random
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import Optimizer

from towers._keras import built_symbolically, call_model, layers_of, own_losses
from towers.combine import in_dtype
from towers.split import batch_size_of, split_sizes, take_rows
from towers.step.rules.forms import Reads
from towers.step.rules.whole_batch import concat_rows

# How a loss reads its batch, the one vocabulary: a mean over its examples,
# a sum of per-example values, a "whole_sum" (a sum whose terms that read no
# tensor of the batch still move with its rows: a draw per row of a static
# shape), or "global" (divided by what only the whole batch holds: its
# sample weights, a mask, a mix of means and sums).
Kind = Literal["mean", "sum", "whole_sum", "global"]
# How far apart a number's value on two examples and the mean (or sum) of
# its values on each may be and still be read as one: a thousandth, far
# above the rounding between a batch of 1 and of 2 (TF32 matmuls on a GPU
# included), far below what a contrastive term shows.
PROBE_RTOL = 1e-3
PROBE_ATOL = 1e-7
# Where a step already differs from one device's, the layer whose outputs
# couple the examples is looked for closer: a tenth of the probe's (an
# embedding's small random values couple a dot product over the batch by
# 1e-3), still far above float32's rounding between batches of 1 and 2.
COUPLING_RTOL = 1e-4


def readings(together: float, one: float, other: float) -> set[str]:
    """Whether a number's value on two examples ``together`` is the ``"mean"``
    or the ``"sum"`` of its values alone (both where 0, neither: coupled).

    >>> sorted(readings(3.0, 1.0, 2.0)), sorted(readings(1.5, 1.0, 2.0))
    (['sum'], ['mean'])
    """
    fits = {"mean": (one + other) / 2, "sum": one + other}
    return {
        name
        for name, expected in fits.items()
        if abs(together - expected)
        <= PROBE_RTOL * max(abs(together), abs(expected)) + PROBE_ATOL
    }


def less_free(pairs: list) -> tuple[list[float], bool]:
    """A number's values on the probe's parts less its batch-free terms, and
    whether those were set apart (not where they moved with the rows)."""
    whole = [float(value) for value, _ in pairs]
    free = [float(free) for _, free in pairs]
    if max(free) - min(free) > 1e-6 * max(map(abs, free)) + 1e-12:
        return whole, False
    return [w - f for w, f in zip(whole, free)], True


def kind_of(model: keras.Model, value: tuple, k: int | None) -> Kind | None:
    """The ``k``-th loss's kind (None: a returned number) from its values."""
    (together, alone0, alone1), apart = value
    fits = readings(together, alone0, alone1)
    if len(fits) == 1:
        kind = fits.pop()
        return kind if kind == "mean" or apart else "whole_sum"
    if fits or k is None:
        return None
    raise ValueError(
        f"{type(model).__name__}.train_step on towers: the loss of its "
        f"tape.gradient call {k + 1}, less its terms that read no example, is "
        f"{together:.6g} on two examples together and {alone0:.6g} and "
        f"{alone1:.6g} on each alone: neither a mean nor a sum over the "
        "examples, so the towers cannot add their gradients up to one "
        "device's. A loss over the whole batch's rows (a contrastive loss) "
        "takes them with towers.gather; else train on one device. Nothing was "
        "updated."
    )


def batch_free(target: tf.Tensor, batch: list[tf.Tensor]) -> tf.Tensor | None:
    """The sum of the scalar ``target``'s additive terms that read no tensor of
    ``batch`` (None: none), through sums, negations, casts and scaling.

    >>> @tf.function(autograph=False)
    ... def free(x, w):
    ...     return batch_free(tf.reduce_sum(x) * 0.5 - 2.0 * w, [x])
    >>> float(free(tf.ones([3]), tf.constant(4.0)))
    -8.0
    """
    reads = Reads(batch)
    found, stack = [], [(target, None)]
    while stack:
        tensor, scale = stack.pop()
        if tensor.shape.rank != 0:
            continue
        if not reads(tensor):
            term = tf.cast(tensor, target.dtype)
            found.append(term if scale is None else term * scale)
            continue
        op, inputs = tensor.op, list(tensor.op.inputs)
        if op.type in ("AddV2", "Add", "AddN", "Identity", "Cast"):
            stack += [(i, scale) for i in inputs if i.dtype.is_floating]
        elif op.type in ("Sub", "Neg"):
            negated = _times(scale, tf.constant(-1.0, target.dtype), target.dtype)
            stack += [(inputs[0], scale if op.type == "Sub" else negated)]
            stack += [(inputs[1], negated)] if op.type == "Sub" else []
        elif op.type == "Mul" and sum(map(reads, inputs)) == 1:
            factor, other = inputs if reads(inputs[1]) else inputs[::-1]
            if factor.shape.rank == 0:
                stack.append((other, _times(scale, factor, target.dtype)))
        elif op.type in ("RealDiv", "DivNoNan") and not reads(inputs[1]):
            if inputs[1].shape.rank == 0:
                inverse = 1 / tf.cast(inputs[1], target.dtype)
                stack.append((inputs[0], _times(scale, inverse, target.dtype)))
    return tf.add_n(found) if found else None


def _times(scale: Any, factor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    factor = tf.cast(factor, dtype)
    return factor if scale is None else scale * factor


def as_mean(grads: list[Any], free_grads: list[Any], share: Any) -> list[Any]:
    """A sum's gradients (or values) as a mean's: ``(g - g_c) / s + g_c``
    each (``free_grads``: the batch-free terms' ``g_c``, None where none)."""
    out = []
    for g, c in zip(grads, free_grads):
        if g is None:
            out.append(None)
            continue
        s = in_dtype(share, g.dtype)  # a float64 model's digits
        if c is None and isinstance(g, tf.IndexedSlices):  # a worker without
            values = tf.math.divide_no_nan(g.values, s)  # examples: s = 0
            out.append(tf.IndexedSlices(values, g.indices, g.dense_shape))
            continue
        g = tf.convert_to_tensor(g)
        c = tf.zeros_like(g) if c is None else tf.convert_to_tensor(c)
        out.append(tf.math.divide_no_nan(g - c, s) + c)
    return out


def nothing(optimizer: Optimizer, grads: Any, variables: Any, own: Any) -> None:
    """An apply while probing: nothing applied."""


def rows_match(both: Any, one: Any, other: Any, rtol: float = PROBE_RTOL) -> bool:
    """Whether the outputs on two examples together are the outputs on each
    alone, row by row, within ``rtol``."""
    for b, o, t in zip(*(tf.nest.flatten(n) for n in (both, one, other))):
        b, apart = _dense(b), _dense(concat_rows([o, t]))
        scale = max(float(np.abs(apart).max(initial=0.0)), 1.0)
        if b.shape != apart.shape or not np.allclose(
            b, apart, rtol=rtol, atol=rtol * scale
        ):
            return False
    return True


def _dense(value: Any) -> np.ndarray:
    """An output's values as an array: ragged rows padded with zeros, sparse
    ones made dense (the rows of two batches compare alike either way)."""
    if isinstance(value, tf.RaggedTensor):
        value = value.to_tensor()
    elif isinstance(value, tf.SparseTensor):
        value = tf.sparse.to_dense(value)
    return np.asarray(value)


def shares_of_terms(
    model: keras.Model, x: Any, towers: int, device: str
) -> tuple[float, float]:
    """The ``add_loss`` terms on ``x``, and as ``towers`` towers add them up."""
    size = int(batch_size_of(x))
    with tf.device(device):
        whole = _training_terms(model, x)
        shares, start = 0.0, 0
        for n in split_sizes(size, towers):
            if n:
                shares += n / size * _training_terms(model, _taken(x, start, start + n))
            start += n
    return whole, shares


def _training_terms(model: keras.Model, x: Any) -> float:
    mapping = [(v, v.value) for v in model.variables]
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
        call_model(model, x, True)
        terms = [t for layer in layers_of(model) for t in own_losses(layer)]
        return sum(float(tf.reduce_sum(tf.cast(t, tf.float64))) for t in terms)


def coupling_layer(model: keras.Model, x: Any, device: str) -> str | None:
    """The first layer whose outputs couple ``x``'s examples (on the first two
    together not its outputs on each alone), else the model; None where none.

    >>> inputs = keras.Input((2,))
    >>> centred = keras.layers.Lambda(lambda v: v - keras.ops.mean(v, 0), name="centre")
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(centred(inputs)))
    >>> coupling_layer(model, np.arange(6.0).reshape(3, 2), "/CPU:0")
    'centre'
    """
    if batch_size_of(x) < 2:
        return None
    layers = [layer for layer in getattr(model, "layers", []) if _has_output(layer)]
    if built_symbolically(model) and layers:
        inner = keras.Model(model.inputs, [layer.output for layer in layers])
        outputs = _outputs_apart(inner, x, device)
        for layer, (both, one, other) in zip(layers, zip(*outputs)):
            if not rows_match(both, one, other, COUPLING_RTOL):
                return layer.name
    both, one, other = _outputs_apart(model, x, device)
    coupled = not rows_match(both, one, other, COUPLING_RTOL)
    return type(model).__name__ if coupled else None


def _has_output(layer: keras.layers.Layer) -> bool:
    try:
        output = layer.output
    except (AttributeError, ValueError):
        return False
    return not isinstance(layer, keras.layers.InputLayer) and output is not None


def _outputs_apart(model: keras.Model, x: Any, device: str) -> tuple:
    """``model``'s outputs on examples 0-1 together, on 0 and on 1."""
    mapping = [(v, v.value) for v in model.variables]
    found = []
    # A call's Python random choices (AugMix's chain) the same for each.
    python_random = random.getstate()
    with tf.device(device):
        for start, stop in ((0, 2), (0, 1), (1, 2)):
            random.setstate(python_random)
            rows = _taken(x, start, stop)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
                found.append(call_model(model, rows, False))
    random.setstate(python_random)
    return tuple(found)


def may_add_terms(model: keras.Model) -> bool:
    """Whether a call of ``model`` may add a loss term: Keras' own layers only
    by an activity regulariser; any other layer may call ``add_loss``."""
    return any(
        not type(layer).__module__.startswith("keras.")
        or type(layer).__module__.endswith("_test")
        or getattr(layer, "activity_regularizer", None) is not None
        for layer in layers_of(model)  # the model first
    )


def _taken(x: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of each of ``x``'s tensors."""
    return tf.nest.map_structure(lambda a: take_rows(a, start, stop), x)

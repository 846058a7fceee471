"""A probe for loss terms that are not a mean over the batch's examples.

On the first training batch of two or more examples, each ``add_loss`` term
and a ``compute_loss`` override's value are computed on the first two examples
together and on each alone (:func:`readings`): a mean takes the mean of its
values alone, a sum their sum, a weight regulariser reads no example. A term
that is neither couples the examples: ``coupled.py`` gathers, refuses or
warns. The model's outputs are compared too: a forward pass that couples the
examples (SigLIP's logits) cannot be made exact by gathering them.

The forward pass runs in inference mode (random draws would differ) and
``compute_loss`` with ``training=True``, in a ``keras.StatelessScope``:
nothing is assigned. Terms a layer adds only in training (keras_hub's
mixture-of-experts blocks) are known by their class instead.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import (
    built_symbolically,
    call_model,
    compute_loss,
    layers_of,
    own_losses,
)
from towers.split import batch_size_of, split_sizes, take_rows
from towers.step.gathered import concat_rows

# How far apart a term's value on two examples and the mean of its values on
# each may be before the probe calls it coupled: a thousandth, far above the
# rounding between a batch of 1 and of 2 (TF32 matmuls on a GPU included),
# far below what a contrastive term or a sum shows.
PROBE_RTOL = 1e-3
# Where a step already differs from one device's, the layer whose outputs
# couple the examples is looked for closer: a tenth of the probe's (an
# embedding's small random values couple a dot product over the batch by
# 1e-3), still far above float32's rounding between batches of 1 and 2.
COUPLING_RTOL = 1e-4
PROBE_ATOL = 1e-7


@dataclasses.dataclass(frozen=True)
class Measured:
    """A loss term the probe found not to be a mean over the examples: its
    value on two examples together, and the mean of its values on each."""

    name: str
    together: float
    each: float
    own_loss: bool = False  # the model's compute_loss, not an add_loss term

    def __str__(self) -> str:
        apart = abs(self.together - self.each) / max(
            abs(self.together), abs(self.each), PROBE_ATOL
        )
        return (
            f"{self.name} is {self.together:.6g} on the first two examples of the "
            f"first batch together and {self.each:.6g} as the mean of its values "
            f"on each alone ({apart:.1%} apart)"
        )


@dataclasses.dataclass
class Probed:
    """What the probe found.

    Attributes:
      coupled: the terms that are neither a mean nor a sum over the examples.
      sums: the ``add_loss`` terms that sum over the examples (each tower's
        adds up to the batch's unweighted), as ``(layer path, index)``.
    """

    coupled: list[Measured]
    sums: list[tuple[str, int]]
    # The model's outputs on the two examples together are not its outputs
    # on each alone (its forward pass couples them: SigLIP's logits).
    outputs_coupled: bool = False


def probe_terms(
    model: keras.Model,
    batch: tuple[Any, Any, Any],
    own_loss: bool,
    device: str,
    training: bool = True,
) -> Probed:
    """The model's loss terms that are not a mean over the examples, found on
    the first two examples of ``batch`` (x, y, sample_weight): every layer's
    ``add_loss`` terms and, with ``own_loss``, the model's ``compute_loss``,
    on ``device``, nothing assigned. A term whose value on the two is the sum
    of its values on each sums over the examples (an ``add_loss`` term of
    ``ops.sum``: each tower's adds up to one device's, taken unweighted).
    ``compute_loss`` is called with ``training``: True as Keras' fit calls it,
    False as its evaluate does.

    A model of Keras' own layers only, none with an activity regulariser,
    and no ``compute_loss`` of its own adds no term: it is not called.

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> probe_terms(model, (np.ones((3, 2)), None, None), False, "/CPU:0")
    Probed(coupled=[], sums=[], outputs_coupled=False)
    """
    if not own_loss and not _may_add_terms(model):
        return Probed([], [])
    with tf.device(device):
        together, both = _term_values(model, _examples(batch, 0, 2), own_loss, training)
        if not together:
            return Probed([], [])  # no add_loss term, no compute_loss: one call
        first, one = _term_values(model, _examples(batch, 0, 1), own_loss, training)
        second, other = _term_values(model, _examples(batch, 1, 2), own_loss, training)
    found = Probed([], [], not _rows_match(both, one, other))
    for key, (name, value) in together.items():
        if key not in first or key not in second:
            continue  # a term added for one batch size only: not comparable
        one, other = first[key][1], second[key][1]
        fits = readings(value, one, other)
        if "mean" in fits:
            continue  # a mean over the examples
        if key[0] != "compute_loss" and "sum" in fits:
            found.sums.append(key)
            continue
        own = key[0] == "compute_loss"
        found.coupled.append(Measured(name, value, (one + other) / 2, own))
    return found


def _rows_match(both: Any, one: Any, other: Any, rtol: float = PROBE_RTOL) -> bool:
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


def readings(together: float, one: float, other: float) -> set[str]:
    """What a term's value on two examples ``together`` is of its values on
    each alone (``one``, ``other``): their ``"mean"``, their ``"sum"``, both
    (where they are 0), or neither (it couples the examples).

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


def _examples(batch: tuple[Any, Any, Any], start: int, stop: int) -> tuple:
    return tuple(
        None
        if part is None
        else tf.nest.map_structure(lambda a: take_rows(a, start, stop), part)
        for part in batch
    )


def _may_add_terms(model: keras.Model) -> bool:
    """Whether a call of ``model`` may add a loss term: Keras' own layers add
    one only through an activity regulariser; any other layer (the model's
    own class included, and one a test module inside Keras' package writes,
    as trainer_test.py's ``add_loss(ops.sum(x))``) may call ``add_loss``."""
    return any(
        not type(layer).__module__.startswith("keras.")
        or type(layer).__module__.endswith("_test")
        or getattr(layer, "activity_regularizer", None) is not None
        for layer in layers_of(model)  # the model first
    )


def _term_values(
    model: keras.Model, batch: tuple[Any, Any, Any], own_loss: bool, training: bool
) -> tuple[dict[tuple, tuple[str, float]], Any]:
    """Each loss term's name and value on ``batch``, by ``(layer path,
    index)`` (``("compute_loss",)`` for the model's override), and the
    model's outputs. The forward
    pass runs in inference mode (its random draws would differ between the
    two examples together and each alone); ``compute_loss`` is called with
    ``training``. In a ``keras.StatelessScope``:
    what the calls assign (a metric's total, a statistic, a seed) stays in
    the scope."""
    x, y, sample_weight = batch
    values = {}
    # Every variable mapped to its value: a weight regulariser reads its
    # variable through the scope.
    mapping = [(v, v.value) for v in model.variables]
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
        y_pred = call_model(model, x, False)
        for layer in layers_of(model):
            terms = own_losses(layer)
            for i, term in enumerate(terms):
                which = (
                    f"'s add_loss term {i}" if len(terms) > 1 else "'s add_loss term"
                )
                name = f"layer {layer.path}{which}"
                values[(layer.path, i)] = (name, _number(term))
        if own_loss:
            loss = compute_loss(model, x, y, y_pred, sample_weight, training)
            name = f"{type(model).__name__}.compute_loss"
            values[("compute_loss",)] = (name, _number(loss))
    return values, y_pred


def _number(value: Any) -> float:
    return float(np.asarray(tf.reduce_sum(tf.cast(value, tf.float64))))


def shares_of_terms(
    model: keras.Model, x: Any, towers: int, device: str
) -> tuple[float, float]:
    """The model's ``add_loss`` terms summed, in training mode, on ``x`` and
    as ``towers`` towers add them up (each shard's weighted by its share of
    the examples), nothing assigned: what taking them per tower changes."""
    size = int(batch_size_of(x))
    with tf.device(device):
        whole = _training_terms(model, x)
        shares, start = 0.0, 0
        for n in split_sizes(size, towers):
            if n:
                part = _examples((x, None, None), start, start + n)[0]
                shares += n / size * _training_terms(model, part)
            start += n
    return whole, shares


def _training_terms(model: keras.Model, x: Any) -> float:
    mapping = [(v, v.value) for v in model.variables]
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
        call_model(model, x, True)
        return sum(_number(t) for layer in layers_of(model) for t in own_losses(layer))


def coupling_layer(model: keras.Model, x: Any, device: str) -> str | None:
    """Where ``model``'s forward pass couples the examples of ``x`` (its
    outputs on the first two together are not its outputs on each alone,
    in inference mode, nothing assigned): the first layer whose outputs do
    so where the model is a graph of layers, else the model; None where
    they do not (or ``x`` has fewer than two examples).

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
            if not _rows_match(both, one, other, COUPLING_RTOL):
                return layer.name
    both, one, other = _outputs_apart(model, x, device)
    coupled = not _rows_match(both, one, other, COUPLING_RTOL)
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
            rows = _examples((x, None, None), start, stop)[0]
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
                found.append(call_model(model, rows, False))
    random.setstate(python_random)
    return tuple(found)

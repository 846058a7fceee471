"""Random draws on the towers as one device draws them.

Every tower starts from the step's seed states (:class:`Starts`), and a draw
with a value per row of the tower's shard gives the tower its rows of the
batch's draw, ``[first, first + n_t)``: a uniform or normal draw (Keras'
``normal``, ``uniform``, ``randint``, Dropout's mask) by moving its Philox
counter on past the rows before (``towers/_keras``'s ``drawn_after``); the
others drawn up to the tower's last row and cut. A draw of any other shape is
every tower's alike. The states then move once. Keras' random functions are
routed here while a step is traced. A shuffle along the examples is refused
by name; in a cluster a worker's rows follow the workers' before it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from towers._keras.patches import drawn_after, routed_draws
from towers.split import batch_size_of
from towers.step.state import state_variables

_here = threading.local()

# Keras' draws made of one stateless uniform or normal draw, which a tower
# draws alone, moved on past the rows before its own (``drawn_after``).
COUNTED = ("normal", "uniform", "randint")


@contextlib.contextmanager
def rows(size: Any, first: Any, total: Any = None) -> Iterator[None]:
    """Within, this thread's tower draws as rows ``[first, first + size)``
    of the batch (``size``: the shard's static rows, None if unknown;
    ``first``: an int or a scalar tensor; ``total``: the batch's rows, where
    known, for a draw over k times the rows: :func:`_blocks`)."""
    before = getattr(_here, "rows", None)
    _here.rows = (tf.compat.dimension_value(size), first, total)
    try:
        yield
    finally:
        _here.rows = before


def route(name: str, own: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Keras' ``name`` draw (``own``) in a tower, as one device's rows.

    >>> def own(shape, seed=None):  # a draw that numbers its values
    ...     return tf.reshape(tf.range(shape[0] * shape[1]), shape)
    >>> with rows(2, 3):  # a tower of rows 3 and 4
    ...     route("truncated_normal", own, ((2, 1),), {}).numpy().ravel().tolist()
    [3, 4]
    """
    where = getattr(_here, "rows", None)
    if where is None:
        return own(*args, **kwargs)
    if name.startswith("tf."):
        return _stateful(name, own, args, kwargs)
    size, first, total = where
    if name == "dropout":
        return _dropout(own, size, first, *args, **kwargs)
    if name == "categorical":
        return _categorical(own, size, first, *args, **kwargs)
    if name == "shuffle":
        x, axis = args[0], kwargs.get("axis", args[1] if len(args) > 1 else 0)
        if axis == 0 and _per_row(tf.TensorShape(x.shape)[:1], size):
            raise ValueError(
                "keras.random.shuffle along the examples on towers shuffles "
                "each tower's rows alone, not the batch's; received a shuffle "
                f"of {x.shape} in a tower's step (MixUp and CutMix layers "
                "shuffle so, to mix examples across the batch). Apply such a "
                "layer in the input pipeline (dataset.map), where it sees the "
                "whole batch, or train on one device. Nothing was updated."
            )
        return own(*args, **kwargs)
    # normal, uniform, truncated_normal, randint, gamma, binomial, beta
    args, kwargs = list(args), dict(kwargs)
    shape = kwargs["shape"] if "shape" in kwargs else args[0]
    if tf.is_tensor(shape):  # tf.shape(x): its values as far as they are known
        known = tf.get_static_value(shape)
        shape = [int(d) for d in known] if known is not None else tf.unstack(shape)
    dims = list(shape) if isinstance(shape, (list, tuple)) else None
    if dims:  # a row count read from a tensor's shape: as the trace knows it
        dims[0] = _static(dims[0])
    if dims and _blocks(dims[0], size):
        if total is not None:
            return _from_blocks(own, args, kwargs, dims, size, first, total)
        _name(
            name, f"draws {dims[0]} rows on a tower of {size}: blocks of its rows, "
            "whose place in one device's draw towers reads in a model's own "
            "train_step in one process only; here every tower draws the same "
            "numbers, not one device's",
        )  # fmt: skip
    if not dims or not _per_row(dims[:1], size):
        return own(*args, **kwargs)
    _check_placed(name, own, args, kwargs)
    if name in COUNTED:  # the tower's values alone
        with drawn_after(_before(first, dims[1:])):
            return own(*args, **kwargs)
    whole = [first + dims[0], *dims[1:]]
    if "shape" in kwargs:
        kwargs["shape"] = whole
    else:
        args[0] = whole
    return _cut(own(*args, **kwargs), first, dims[0])


# The stateful ops named already (once a model: ``(id(model), op name)``),
# the model whose step is traced, and the ops met since the probe began
# (``loss_kinds.probe``).
_named: set[tuple[int, str]] = set()
_drawing: list[int] = [0]
stateful_met: set[str] = set()


def _stateful(name: str, own: Callable[..., Any], args: tuple, kwargs: dict):
    """A TensorFlow stateful random op in a tower's step: each op draws from
    a seed of its own, which no tower shares with one device's op, so its
    numbers are the tower's own. Named once, never silent."""
    stateful_met.add(name)
    _name(
        name, f"TensorFlow's stateful {name[3:]} (tf.random.normal, "
        "tf.random.uniform, ...) draws from the op's own seed: each tower draws "
        "its own numbers, not one device's for its examples (and a model's own "
        "train_step's losses are read as means over its examples, which towers "
        "cannot find through such a draw). Draw with keras.random and a "
        "keras.random.SeedGenerator for one device's numbers",
    )  # fmt: skip
    return own(*args, **kwargs)


def _name(draw: str, why: str) -> None:
    """Warns once a model that ``draw`` is not one device's, saying ``why``."""
    if (_drawing[0], draw) not in _named:
        _named.add((_drawing[0], draw))
        warnings.warn(f"towers: a draw of the step, {draw}: {why}.", stacklevel=4)


def _blocks(rows: Any, size: Any) -> bool:
    """Whether a draw of ``rows`` rows is ``k >= 2`` blocks of the shard's
    ``size`` (the fit guide's label noise over its fake and real rows,
    concatenated): one device's is k blocks of the batch's rows."""
    known = isinstance(rows, int) and isinstance(size, int) and size > 0
    return known and rows % size == 0 and rows > size


def _from_blocks(own, args: list, kwargs: dict, dims: list, size, first, total):
    """One device's draw of k blocks of the batch's rows, made whole, and the
    tower's rows of each block, in block order."""
    _check_placed("draw", own, args, kwargs)
    blocks = dims[0] // size
    whole = [blocks * total, *dims[1:]]
    if "shape" in kwargs:
        kwargs["shape"] = whole
    else:
        args[0] = whole
    starts = tf.range(blocks) * total + tf.cast(first, tf.int32)
    rows = tf.reshape(starts[:, None] + tf.range(size)[None, :], [-1])
    return tf.gather(own(*args, **kwargs), rows)


def _check_placed(name: str, own: Callable[..., Any], args: tuple, kwargs: dict):
    """Refuses a draw with a value per row from Keras' global seed generator
    (``seed=None``) in a cluster whose model has no seed generator of its
    own: nothing told the workers where their rows are (:func:`drawing`)."""
    if not getattr(_here, "unplaced", False):
        return
    if inspect.signature(own).bind(*args, **kwargs).arguments.get("seed") is None:
        raise ValueError(
            f"keras.random.{name} with seed=None draws from Keras' global seed "
            "generator, whose rows towers cannot place in a cluster's global "
            "batch; received one with a value per example in a worker's step, "
            "in a model with no seed generator of its own. Give the layer a "
            "keras.random.SeedGenerator and pass it as seed=. Nothing was "
            "updated."
        )


def _per_row(leading: Any, size: Any) -> bool:
    """Whether a first axis ``leading`` (a shape's first entry, in a list)
    is as long as the tower's rows."""
    dim = _static(leading[0])
    return (None if isinstance(dim, tf.Tensor) else dim) == size


def _static(dim: Any) -> Any:
    """A shape's entry as a number where the trace knows it, else itself:
    ``tf.shape(x)[i]`` of an ``x`` whose static shape has it, which
    ``tf.get_static_value`` does not read through the slice."""
    if not isinstance(dim, tf.Tensor):
        return tf.compat.dimension_value(dim)
    known = tf.get_static_value(dim)
    if known is not None:
        return int(known)
    op = dim.op
    if op.type != "StridedSlice" or op.get_attr("shrink_axis_mask") != 1:
        return dim
    index, source = tf.get_static_value(op.inputs[1]), op.inputs[0]
    whole = tf.get_static_value(source)  # a shape the trace folded
    if whole is None and source.op.type == "Shape":
        shape = source.op.inputs[0].shape
        whole = None if shape.rank is None else shape.as_list()
    if whole is None or index is None or whole[int(index[0])] is None:
        return dim
    return int(whole[int(index[0])])


def _cut(whole: tf.Tensor, first: Any, size: Any) -> tf.Tensor:
    """Rows ``[first, first + size)`` of ``whole``."""
    begin = tf.stack([tf.cast(first, tf.int32)] + [0] * (whole.shape.rank - 1))
    size = tf.stack([tf.cast(size, tf.int32)] + [-1] * (whole.shape.rank - 1))
    return tf.slice(whole, begin, size)


def _dropout(own, size, first, inputs, rate, noise_shape=None, seed=None):
    """Keras' dropout of ``inputs``, its mask the tower's rows of the batch's
    (its uniform draw moved on by the rows before the tower's)."""
    inputs = tf.convert_to_tensor(inputs)
    if noise_shape is None:
        noise_shape = [None] * inputs.shape.rank
    if not _per_row([inputs.shape[0]], size) or noise_shape[0] == 1:
        return own(inputs, rate, noise_shape=noise_shape, seed=seed)
    _check_placed("dropout", own, (inputs, rate), {"seed": seed})
    dynamic = tf.shape(inputs)
    rest = [dynamic[i] if d is None else d for i, d in enumerate(noise_shape)][1:]
    with drawn_after(_before(first, rest)):
        return own(inputs, rate, noise_shape=noise_shape, seed=seed)


def _before(first: Any, row: list[Any]) -> Any:
    """How many values of a draw come before row ``first`` (each row ``row``
    shaped)."""
    values = tf.cast(first, tf.int64)
    for d in row:
        values *= tf.cast(d, tf.int64)
    return values


def _categorical(own, size, first, logits, num_samples, *args, **kwargs):
    """Samples of the tower's rows of logits, drawn as the batch's: its rows
    after ``first`` rows of zeros (each row's samples read its own row)."""
    logits = tf.convert_to_tensor(logits)
    if not _per_row([logits.shape[0]], size):
        return own(logits, num_samples, *args, **kwargs)
    _check_placed("categorical", own, (logits, num_samples, *args), kwargs)
    n = tf.shape(logits)[0]
    padded = tf.pad(logits, [[tf.cast(first, tf.int32), 0], [0, 0]])
    return _cut(own(padded, num_samples, *args, **kwargs), first, n)


def first_rows(shards: Any) -> list[Any]:
    """Each tower's first row in the batch (in a cluster, the global batch,
    as :func:`drawing` says): ints when known when traced, else scalar
    tensors."""
    sizes = shards.sizes or [batch_size_of(part) for part in shards.parts]
    before = getattr(_here, "worker_first", 0)
    return [sum(sizes[:t], before) for t in range(len(sizes))]


@contextlib.contextmanager
def drawing(workers: Any, models: list[Any], examples: Any) -> Iterator[None]:
    """Within (a step's towers traced), Keras' draws are routed to
    :func:`route`; in a cluster, the towers' rows are placed in the global
    batch after the workers before this one (``workers.first_row``, one small
    sum over the workers), when the towers' ``models`` draw at all."""
    draw = any(state_variables(model) for model in models)
    _drawing[0] = id(models[0])
    with routed_draws(route):
        if workers is None:
            yield
            return
        if draw:
            _here.worker_first = workers.first_row(examples)
        _here.unplaced = not draw  # a draw from the global generator is refused
        try:
            yield
        finally:
            _here.worker_first, _here.unplaced = 0, False


def shard_size() -> Any:
    """The rows of this thread's tower's shard as traced (:func:`rows`;
    None: unknown until it runs, or no tower's rows set)."""
    where = getattr(_here, "rows", None)
    return None if where is None else where[0]


def size_of(x: Any) -> int | None:
    """A shard's rows as traced (None: known when it runs)."""
    size = batch_size_of(x)
    return size if isinstance(size, int) else None


class Starts:
    """The seed generators' states every tower of a step starts from, read
    once; the first tower's last states, assigned once after the towers.

    Args:
      models: the models the working towers run (one, or a copy each).
    """

    def __init__(self, models: list[Any]):
        self.models = {id(model): model for model in models}
        self.states = {
            key: [tf.identity(v) for v in state_variables(model)]
            for key, model in self.models.items()
        }
        self._ends: dict[int, list[Any]] = {}

    def of(self, model: Any) -> list[Any]:
        """The states ``model``'s towers start from."""
        return self.states[id(model)]

    def ended(self, model: Any, states: list[Any]) -> None:
        """A tower of ``model`` ended with ``states`` (the first one counts)."""
        self._ends.setdefault(id(model), states)

    def settle(self) -> None:
        """Assigns each model's states as its first tower ended them."""
        for key, model in self.models.items():
            for variable, value in zip(state_variables(model), self._ends[key]):
                variable.assign(value)

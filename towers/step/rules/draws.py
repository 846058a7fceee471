"""Random draws on the towers as one device draws them.

Every tower starts from the step's seed states (:class:`Starts`); a draw
with a value per row gives the tower its rows of the batch's draw: a
uniform or normal draw by moving its Philox counter past the rows before
(``towers/_keras``'s ``drawn_after``), others drawn up to its last row and
cut. A draw of any other shape is every tower's alike. The states move
once. A shuffle along the examples is refused by name."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras.patches import drawn_after, routed_draws
from towers.cluster.workers import Workers
from towers.step.rules import places
from towers.step.rules.forms import static_dim
from towers.step.rules.state import state_variables

# Keras' draws made of one stateless uniform or normal draw, which a tower
# draws alone, moved on past the rows before its own (``drawn_after``).
COUNTED = ("normal", "uniform", "randint")


def route(name: str, own: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Keras' ``name`` draw (``own``) in a tower, as one device's rows.

    >>> def own(shape, seed=None):  # a draw that numbers its values
    ...     return tf.reshape(tf.range(shape[0] * shape[1]), shape)
    >>> with places.rows(2, 3):  # a tower of rows 3 and 4
    ...     route("truncated_normal", own, ((2, 1),), {}).numpy().ravel().tolist()
    [3, 4]
    """
    if not places.in_tower():
        return own(*args, **kwargs)
    if name.startswith("tf."):
        return _stateful(name, own, args, kwargs)
    if name == "dropout":
        return _dropout(own, *args, **kwargs)
    if name == "categorical":
        return _categorical(own, *args, **kwargs)
    if name == "shuffle":
        x, axis = args[0], kwargs.get("axis", args[1] if len(args) > 1 else 0)
        if axis == 0 and places.place(tf.TensorShape(x.shape)[0], name) is not None:
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
    shaped = tf.is_tensor(shape)  # read from a tensor's shape, not a number
    if shaped:  # tf.shape(x): its values as far as they are known
        known = tf.get_static_value(shape)
        shape = [int(d) for d in known] if known is not None else tf.unstack(shape)
    dims = list(shape) if isinstance(shape, (list, tuple)) else None
    shaped = shaped or bool(dims) and tf.is_tensor(dims[0])
    place = places.place(dims[0], name, shaped) if dims else None
    if place is None:
        return own(*args, **kwargs)
    if not place[3]:
        return _unplaced(name, own, args, kwargs)
    size, first, total, blocks = place
    places.check_placed(name, own, args, kwargs)
    if blocks > 1:
        dims[0] = size
        return _from_blocks(own, args, kwargs, dims, size, first, total, blocks)
    if size is not None and static_dim(dims[0]) != size:  # the batch's rows
        dims[0] = size
        _shape(args, kwargs, dims)
    if name in COUNTED:  # the tower's values alone
        with drawn_after(_before(first, dims[1:])):
            return own(*args, **kwargs)
    _shape(args, kwargs, [first + dims[0], *dims[1:]])
    return _cut(own(*args, **kwargs), first, dims[0])


def _shape(args: list, kwargs: dict, shape: list) -> None:
    """Sets a draw's shape argument to ``shape``."""
    if "shape" in kwargs:
        kwargs["shape"] = shape
    else:
        args[0] = shape


def _stateful(name: str, own: Callable[..., Any], args: tuple, kwargs: dict):
    # A TensorFlow stateful random op draws from a seed of its own, which no
    # tower shares with one device's: named once, never silent.
    places.name(
        name, f"TensorFlow's stateful {name[3:]} (tf.random.normal, "
        "tf.random.uniform, ...) draws from the op's own seed: each tower draws "
        "its own numbers, not one device's for its examples. Draw with "
        "keras.random and a keras.random.SeedGenerator for one device's numbers",
    )  # fmt: skip
    return _unplaced(name, own, args, kwargs)


# A draw's middle, by the argument it is read from (a number: itself).
MIDDLES = {"normal": "mean", "truncated_normal": "mean", "uniform": None,
           "randint": "minval", "tf.random_uniform": 0.5,
           "tf.random_standard_normal": 0.0, "tf.truncated_normal": 0.0,
           "tf.random_uniform_int": "minval", "tf.random_shuffle": "value"}  # fmt: skip


def _unplaced(name: str, own: Callable[..., Any], args: tuple, kwargs: dict):
    """A draw towers cannot place: its own numbers; while the probe runs
    (:func:`steady`), its middle (``MIDDLES``; the value a shuffle takes)."""
    if not places.steadied() or name not in MIDDLES:
        return own(*args, **kwargs)
    bound = inspect.signature(own).bind(*args, **kwargs)
    bound.apply_defaults()
    given, middle = bound.arguments, MIDDLES[name]
    if middle == "value":
        return tf.convert_to_tensor(given["value"])
    if middle is None:  # uniform's
        middle = (given["minval"] + given["maxval"]) / 2
    value = given[middle] if isinstance(middle, str) else middle
    dtype = given.get("dtype")
    if dtype is None and name != "tf.random_uniform_int":  # its minval's
        dtype = keras.config.floatx()
    if dtype is not None:
        value = tf.cast(value, keras.backend.standardize_dtype(dtype))
    return tf.fill(given["shape"], value)


def _from_blocks(own, args: list, kwargs: dict, dims: list, size, first, total, blocks):
    """One device's draw of ``blocks`` blocks of the batch's rows, made
    whole, and the tower's rows of each block, in block order."""
    _shape(args, kwargs, [blocks * total, *dims[1:]])
    starts = tf.range(blocks) * total + tf.cast(first, tf.int32)
    rows = tf.reshape(starts[:, None] + tf.range(size)[None, :], [-1])
    return tf.gather(own(*args, **kwargs), rows)


def _single(rows: Any, draw: str) -> tuple | None:
    """:func:`places.place` for a draw towers place by its rows alone (a mask, a
    sample per row): blocks of them are named, not placed."""
    place = places.place(rows, draw)
    if place is not None and not place[3]:
        return None
    if place is not None and place[3] > 1:
        places.name(draw, f"over {place[3]} blocks of a tower's rows, which towers "
              "place for keras.random's draws alone; here every tower draws the "
              "same numbers, not one device's")  # fmt: skip
        return None
    return place


def _cut(whole: tf.Tensor, first: Any, size: Any) -> tf.Tensor:
    """Rows ``[first, first + size)`` of ``whole``."""
    begin = tf.stack([tf.cast(first, tf.int32)] + [0] * (whole.shape.rank - 1))
    size = tf.stack([tf.cast(size, tf.int32)] + [-1] * (whole.shape.rank - 1))
    return tf.slice(whole, begin, size)


def _dropout(own, inputs, rate, noise_shape=None, seed=None):
    """Keras' dropout of ``inputs``, its mask the tower's rows of the batch's
    (its uniform draw moved on by the rows before the tower's)."""
    inputs = tf.convert_to_tensor(inputs)
    if noise_shape is None:
        noise_shape = [None] * inputs.shape.rank
    place = None if noise_shape[0] == 1 else _single(inputs.shape[0], "dropout")
    if place is None:
        return own(inputs, rate, noise_shape=noise_shape, seed=seed)
    first = place[1]
    places.check_placed("dropout", own, (inputs, rate), {"seed": seed})
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


def _categorical(own, logits, num_samples, *args, **kwargs):
    """Samples of the tower's rows of logits, drawn as the batch's: its rows
    after ``first`` rows of zeros (each row's samples read its own row)."""
    logits = tf.convert_to_tensor(logits)
    place = _single(logits.shape[0], "categorical")
    if place is None:
        return own(logits, num_samples, *args, **kwargs)
    first = place[1]
    places.check_placed("categorical", own, (logits, num_samples, *args), kwargs)
    n = tf.shape(logits)[0]
    padded = tf.pad(logits, [[tf.cast(first, tf.int32), 0], [0, 0]])
    return _cut(own(padded, num_samples, *args, **kwargs), first, n)


@contextlib.contextmanager
def drawing(
    workers: Workers | None,
    models: list[keras.Model],
    examples: Any,
    hook: str = "",
    learned: places.Learned | None = None,
) -> Iterator[None]:
    """Within, Keras' draws are routed to :func:`route`, the towers' rows placed
    (``places.placing``)."""
    draw = any(state_variables(model) for model in models)
    placed = places.placing(workers, examples, draw, hook, learned)
    with routed_draws(route), placed:
        yield


class Starts:
    """The seed states every tower of a step starts from, read once; the first
    tower's last states assigned once after (``models``: the towers')."""

    def __init__(self, models: list[keras.Model]):
        self.models = {id(model): model for model in models}
        self.states = {
            key: [tf.identity(v) for v in state_variables(model)]
            for key, model in self.models.items()
        }
        self._ends: dict[int, list[Any]] = {}

    def of(self, model: keras.Model) -> list[Any]:
        """The states ``model``'s towers start from."""
        return self.states[id(model)]

    def ended(self, model: keras.Model, states: list[Any]) -> None:
        """A tower of ``model`` ended with ``states`` (the first one counts)."""
        self._ends.setdefault(id(model), states)

    def settle(self) -> None:
        """Assigns each model's states as its first tower ended them."""
        for key, model in self.models.items():
            for variable, value in zip(state_variables(model), self._ends[key]):
                variable.assign(value)

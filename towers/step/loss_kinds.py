"""How a model's own step's loss depends on its batch: found, not declared.

The towers weigh each gradient by their share ``s_t = n_t / B``: one device's
for a loss that is a mean over the shard's examples (Keras' losses,
``ops.mean``, a sum over a batch size read from the data). Set apart the
terms that read no example (a weight penalty, ``c``), and a sum (``ops.sum``,
a value per example, which the tape sums) is handed in as a mean's:
``(g - g_c) / s_t + g_c`` (:func:`as_mean`), its value too.

:func:`probe` finds which before the first step: the step runs with nothing
applied or kept on two examples together and on each alone (``probe.py``'s
:func:`readings`), each loss less its batch-free terms (:func:`batch_free`,
read from its graph). A loss that is neither couples the examples and is
refused by name before any update, unless the step gathers the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import keras
import tensorflow as tf

from towers._keras import layers_of
from towers._keras.current import setting, this_tower
from towers._keras.patches import (
    Patch,
    batch_norm_replacements,
    own_moments,
    routed_applies,
    routed_gradients,
)
from towers.combine import in_dtype
from towers.split import take_rows, units_of
from towers.step import draws, places
from towers.step.probe import readings
from towers.step.state import Reads

# "whole_sum": a sum whose terms that read no tensor of the batch still move
# with its rows (a draw per row of a static shape): nothing is set apart.
Kind = Literal["mean", "sum", "whole_sum"]

# Pairs of examples tried while a loss is zero on them (both readings fit).
PAIRS = 4


def batch_free(target: tf.Tensor, batch: list[tf.Tensor]) -> tf.Tensor | None:
    """The sum of the additive terms of the scalar ``target`` that read no
    tensor of ``batch`` (None: there are none). Terms are followed through
    sums, differences, negations, casts and scaling by such terms.

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


def gathered() -> None:
    """Marks the step being probed as one that gathers the batch's rows
    (``towers.gather``): its loss is the whole batch's on every tower."""
    recorder = this_tower().recorder
    if recorder is not None:
        recorder.gathers = True


@dataclasses.dataclass
class Found:
    """What :func:`probe` found: the kind of each loss the step took the
    gradient of, in call order (None: not probed), and of each number the
    step returns, by its key (a key that is neither is left out)."""

    losses: list[Kind] | None
    logs: dict[str, Kind]


def probe(model: keras.Model, batch: tuple, hook: str = "train_step") -> Found:
    """How the model's ``hook`` (its ``train_step`` or ``test_step``) reads
    the batch, on two examples together and on each alone. A loss with a
    value per example is a sum (the tape sums it); a vector of another length
    (a mean per output) is read as its sum.

    Raises:
      ValueError: a loss that is neither a mean nor a sum over the examples.
    """
    size = units_of(batch)[0]  # a part's rows each (towers/split.py)
    if size < 2:
        return Found(None, {})
    recorder = _Recorder(model, hook, places.size_of(batch[0]))
    kinds: list[Any] = []
    logs: dict[str, Any] = {}
    for first in range(0, min(size - 1, 2 * PAIRS), 2):
        parts = [_rows(batch, first, first + 2)]
        parts += [_rows(batch, first + i, first + i + 1) for i in (0, 1)]
        losses, returned = recorder.recorded(parts)
        losses = [_less_free([pair.numpy() for pair in part]) for part in zip(*losses)]
        for key in returned[0]:
            value = _less_free([variant[key].numpy() for variant in returned])
            logs.setdefault(key, _kind(model, value, None))
        if recorder.gathers:  # the whole batch's loss on every tower
            return Found(["mean"] * len(losses), {})
        read = [  # a value per row the tape sums, unless its values say else
            _kind(model, value, k) or ("sum" if rows else None)
            for k, (rows, value) in enumerate(zip(recorder.per_row(), losses))
        ]
        kinds = [old or new for old, new in zip(kinds, read)] if kinds else read
        if all(kinds):
            break
    logs = {key: kind for key, kind in logs.items() if kind}
    return Found([kind or "mean" for kind in kinds], logs)  # 0 on every pair: either


def misfit(model: keras.Model, hook: str, error: ValueError) -> ValueError | None:
    """``error``, raised while ``hook`` ran on a part of the batch, named
    where the part's shapes did not fit the step's (None: another error)."""
    text = str(error)
    if not any(k in text for k in ("Dimensions must be equal", "Incompatible")):
        return None
    return ValueError(
        f"{type(model).__name__}.{hook} on towers runs on each tower's share of "
        f"the batch, and a share did not fit it: {text.splitlines()[0]} A shape "
        "the step takes from a fixed batch size, not from its data "
        "(keras.ops.shape(x)[0]), does not fit a share: read it from the data, "
        "or train on one device. Nothing was updated."
    )


def _rows(batch: tuple, start: int, stop: int) -> tuple:
    """Units ``[start, stop)`` of ``batch``: so many rows of each part."""
    units, rows = units_of(batch)
    taken = [
        None if n is None else take_rows(leaf, start * n // units, stop * n // units)
        for leaf, n in zip(tf.nest.flatten(batch), rows)
    ]
    return tf.nest.pack_sequence_as(batch, taken)


def _less_free(pairs: list) -> tuple[list[float], bool]:
    """A number's values on the three parts less its batch-free terms, and
    whether those terms were set apart: not where they differ from part to
    part (they moved with the rows after all)."""
    whole = [float(value) for value, _ in pairs]
    free = [float(free) for _, free in pairs]
    if max(free) - min(free) > 1e-6 * max(map(abs, free)) + 1e-12:
        return whole, False
    return [w - f for w, f in zip(whole, free)], True


def _kind(model: keras.Model, value: tuple, k: int | None) -> Kind | None:
    """The kind of the ``k``-th loss (None: a number the step returns) from
    :func:`_less_free`'s values (None: either fits; a returned number that
    is neither)."""
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


class _Recorder:
    """The model's ``hook`` run on each of three parts (two examples, then
    each alone), nothing applied or kept; per part, each loss it takes the
    gradient of and each number it returns, less their batch-free terms."""

    def __init__(self, model: keras.Model, hook: str, rows: int | None):
        self.model, self.hook = model, hook
        self.rows = rows  # the batch's: a draw over them is over a part's
        self.leading: list[list[Any]] = []  # per part, each loss's first axis
        self.gathers = False  # the step called towers.gather
        self._losses: list[tf.Tensor] | None = None
        self._traced: Any = None  # run, as a tf.function
        self.drawn: list[list[Any]] = []  # per part, its draws' row counts
        self._batch: list[tf.Tensor] = []

    def recorded(self, parts: list[tuple]) -> tuple:
        """:meth:`run` on ``parts``. A draw over a number of rows that is both
        the batch's and blocks of a part's is read as the batch's (a fixed
        batch_size), or where the step then fails on the parts, as blocks;
        what each draw asked for on the parts then says which it is
        (``places.learn``)."""
        failed = None
        for reading in (True, False):
            if self._traced is None:
                places.learn(self.model, self.hook, None, reading)
                self._traced = tf.function(self.run, autograph=False)
            try:
                out = self._traced(*parts)
            except ValueError as error:
                self._traced = None
                failed = failed or error
                if places.learn(self.model, self.hook, None) and reading:
                    continue  # read as blocks
                named = misfit(self.model, self.hook, failed)
                if named is None:
                    raise failed from (None if failed is error else error)
                raise named from failed
            places.learn(self.model, self.hook, self.drawn)
            return out
        raise AssertionError("both readings returned or raised")

    def run(self, *parts: tuple) -> tuple[list[list[tf.Tensor]], list[dict]]:
        out, logs, steady = [], [], _Steady(self.model)
        self.drawn = []
        with setting(recorder=self):
            with routed_gradients(self._gradient), routed_applies(nothing):
                drawing = draws.drawing(None, [self.model], 2, self.hook)
                with drawing, places.steady(), steady.patched():
                    self.leading = []
                    for (x, y, sw), first in zip(parts, (None, 0, 1)):
                        self._losses = []
                        self.leading.append([])
                        self._batch = tf.nest.flatten((x, y, sw), True)
                        rows = places.size_of(x)  # a unit's or two's
                        whole = 2 * rows if first is not None else rows
                        placed = places.rows_of(
                            (x, y, sw), rows * (first or 0), whole, self.rows
                        )
                        with keras.StatelessScope(), placed as tower:
                            data = keras.utils.pack_x_y_sample_weight(x, y, sw)
                            returned = getattr(self.model, self.hook)(data)
                            self.drawn.append(list(tower.drawn))
                        out.append(self._losses)
                        logs.append(self._numbers(returned))
        keys = set.intersection(*(set(numbers) for numbers in logs))
        return out, [
            {k: v for k, v in numbers.items() if k in keys} for numbers in logs
        ]

    def _numbers(self, logs: Any) -> dict[str, tf.Tensor]:
        """The step's returned float numbers by key (nested dicts' entries by
        theirs), each less its batch-free terms."""
        numbers = {}
        for key, value in logs.items() if isinstance(logs, dict) else []:
            if isinstance(value, dict):
                numbers.update(self._numbers(value))
            elif tf.is_tensor(value) and tf.as_dtype(value.dtype).is_floating:
                value = tf.convert_to_tensor(value)  # a variable: its value
                if value.shape.rank != 0:
                    continue
                numbers[key] = _with_free(value, batch_free(value, self._batch))
        return numbers

    def per_row(self) -> list[bool]:
        """Per loss: whether it has a value per example (a first axis as
        long as a part's rows: twice as long on the two units), which the
        tape sums."""
        return [
            bool(alone) and together == 2 * alone == 2 * other
            for together, alone, other in zip(*self.leading)
        ]

    def _gradient(self, target: Any, sources: Any, own: Any) -> Any:
        loss = tf.convert_to_tensor(target)
        self.leading[-1].append(loss.shape[0] if loss.shape.rank else None)
        free = batch_free(loss, self._batch) if loss.shape.rank == 0 else None
        self._losses.append(_with_free(tf.reduce_sum(loss), free))
        return own(target)


def _with_free(value: tf.Tensor, free: tf.Tensor | None) -> tf.Tensor:
    """``[value, its batch-free terms]`` (0 for none), float64."""
    free = tf.zeros_like(value) if free is None else free
    return tf.cast(tf.stack([value, tf.cast(free, value.dtype)]), tf.float64)


def nothing(optimizer: Any, grads: Any, variables: Any, own: Any) -> None:
    """An apply while probing: nothing applied."""


class _Steady:
    """BatchNormalization normalising every part with its moving moments:
    the same moments for each part, as the towers share the whole batch's
    under global statistics, so no example reads another through them. (The
    two examples' own moments would serve in exact arithmetic, but a deep
    float32 network amplifies the rounding between a batch of one and of two
    through them past any tolerance: MobileNetV2 read 2.85 on two examples
    and 3.31 and 3.82 alone.)"""

    def __init__(self, model: keras.Model):
        normalising = keras.layers.BatchNormalization
        self.layers = [x for x in layers_of(model) if isinstance(x, normalising)]

    def patched(self) -> Any:
        return Patch(
            lambda: [r for layer in self.layers
                     for r in batch_norm_replacements(layer, _moving(layer))]
        ).applied()  # fmt: skip


def _moving(layer: Any) -> Any:
    """A BatchNormalization ``layer``'s moments: its moving ones, shaped as
    its own."""
    own = own_moments(layer)

    def moments(inputs: Any, mask: Any) -> Any:
        shaped = own(inputs, mask)
        return [
            tf.reshape(tf.cast(moving, m.dtype), tf.shape(m))
            for moving, m in zip((layer.moving_mean, layer.moving_variance), shaped)
        ]

    return moments

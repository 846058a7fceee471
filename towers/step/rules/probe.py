"""The one probe: how a step's tower work reads its batch, found before the
first step.

The work runs on two examples together and on each alone, traced once for
parts of any rows (once per part's shape where it draws) and run, nothing
applied or kept: a model's own ``train_step`` or ``test_step``
(:func:`probe`), or the built-in step's forward pass and its loss terms
(``loss_terms.probe_terms``). Each number is read less its terms that read no
example (``loss_kinds.batch_free``, read from its graph): a mean takes the
mean of its values alone, a sum their sum; one that is neither couples the
examples (a contrastive loss, a variance over the batch), gathered or
refused by name before any update (``coupled.py``, ``own.py``).

Every draw takes its rows of the two examples' draw (``places.py``), and
BatchNormalization normalises with its moving moments (``batchnorm.Steady``).
The built-in step's forward pass runs in inference mode: terms a layer adds
only in training (keras_hub's mixture-of-experts blocks) are known by their
class (``coupled.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras.current import setting, this_tower
from towers._keras.patches import (
    Patch,
    raw_assignments,
    routed_applies,
    routed_gradients,
)
from towers.split import examples_of, take_rows, units_of
from towers.step.rules import draws, places
from towers.step.rules.batchnorm import Steady
from towers.step.rules.loss_kinds import (
    PROBE_ATOL,
    Kind,
    batch_free,
    kind_of,
    less_free,
    nothing,
    readings,
)
from towers.step.rules.state import raw_variables
from towers.step.work.hooks import own_hook, raised_in_towers

# Pairs of examples tried while a loss is zero on them (both readings fit).
PAIRS = 4


@dataclasses.dataclass(frozen=True)
class Measured:
    """A number the probe found neither a mean nor a sum over the examples:
    its value on two examples together, and the mean of its values on each."""

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
class Found:
    """What :func:`probe` found: the kind of each loss the step took the
    gradient of, in call order (None: not probed); of each number the step
    returns, by its key (one that is either is left out, one that is neither
    is in ``neither``), and its values (``measured``); and the work's kept
    outputs, per part."""

    losses: list[Kind] | None
    logs: dict[str, Kind]
    measured: dict[str, Measured] = dataclasses.field(default_factory=dict)
    neither: set[str] = dataclasses.field(default_factory=set)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    unprobed: str | None = None  # why the work ran on no part, if it did not


def probe(
    model: keras.Model, batch: tuple, hook: Any = "train_step", towers: int = 2
) -> Found:
    """How ``hook`` reads ``batch``: the model's ``train_step`` or
    ``test_step`` by name, or a function of the packed data (``(name,
    work)``) returning numbers by key (and, in ``work.kept``, what to keep).
    A loss with a value per example is a sum (the tape sums it); a vector of
    another length (a mean per output) is read as its sum.

    Parts of one example each come first; a work that does not run on them
    (a ``top_k`` over the batch, rows paired by a reshape) is probed on
    parts of a shard's rows of ``towers`` (what the towers will run), and
    one that runs on neither is not probed: ``unprobed`` says why, and the
    first-step check decides (``training/check.py``).

    Raises:
      ValueError: a loss that is neither a mean nor a sum over the examples;
        a towers' refusal raised while the work ran (a draw it cannot place).
    """
    size = units_of(batch)[0]  # a part's rows each (towers/split.py)
    shard = size // max(towers, 1)
    tried = sorted({1, shard} - {0}) if size >= 2 else []
    failed = None
    for unit in tried:
        try:
            return _probe(model, batch, hook, size, unit)
        except Exception as error:  # noqa: BLE001 - the model's, or ours: below
            if raised_in_towers(error):
                raise
            failed = failed or error
    if failed is None:
        return Found(None, {})
    named = misfit(model, hook if isinstance(hook, str) else hook[0], failed)
    if named is not None:
        raise named from failed
    first = (str(failed).strip().splitlines() or [""])[0][:160]
    why = f"{type(failed).__name__}: {first}"
    name = hook if isinstance(hook, str) else "forward pass"
    warnings.warn(
        f"towers' probe of how {type(model).__name__}'s {name} reads its batch "
        f"did not run on one example, nor on a tower's share ({why}): whether "
        "its towers' step is one device's is left to the first-step check "
        "(check_first_step=True).",
        stacklevel=3,
    )
    return Found(None, {}, unprobed=why)


def _probe(model: keras.Model, batch: tuple, hook: Any, size: int, unit: int) -> Found:
    """:func:`probe` on parts of ``2 * unit`` units together and ``unit``
    alone."""
    recorder = _Recorder(model, hook, places.size_of(batch[0]))
    kinds: list[Any] = []
    found = Found([], {})
    for first in range(0, size - 2 * unit + 1, 2 * unit)[:PAIRS]:
        parts = [_rows(batch, first, first + 2 * unit)]
        parts += [
            _rows(batch, first + i * unit, first + (i + 1) * unit) for i in (0, 1)
        ]
        losses, returned, kept = recorder.recorded(parts)
        losses = [less_free([pair.numpy() for pair in part]) for part in zip(*losses)]
        for key in returned[0] if first == 0 else []:
            pairs = [variant[key].numpy() for variant in returned]
            together, one, other = (float(value) for value, _ in pairs)
            found.measured[key] = Measured(key, together, (one + other) / 2)
            less, apart = less_free(pairs)
            kind = kind_of(model, (less, apart), None)
            if kind:
                found.logs[key] = kind
            elif not readings(*less):
                found.neither.add(key)
        found.outputs = found.outputs or kept
        if recorder.gathers:  # the whole batch's loss on every tower
            return Found(["mean"] * len(losses), {})
        read = [  # a value per row the tape sums, unless its values say else
            kind_of(model, value, k) or ("sum" if rows else None)
            for k, (rows, value) in enumerate(zip(recorder.per_row(), losses))
        ]
        kinds = [old or new for old, new in zip(kinds, read)] if kinds else read
        if all(kinds):
            break
    found.losses = [kind or "mean" for kind in kinds]  # 0 on every pair: either
    return found


def gathered() -> None:
    """Marks the step probed as one whose loss is the whole batch's on
    every tower (it called ``towers.gather``)."""
    recorder = this_tower().recorder
    if recorder is not None:
        recorder.gathers = True


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


class _Recorder:
    """The work run on each of three parts (two examples, then each alone),
    nothing applied or kept; per part, each loss it takes the gradient of
    and each number it returns, less their batch-free terms."""

    def __init__(self, model: keras.Model, hook: Any, rows: int | None):
        self.model = model
        self.hook, self.work = hook if isinstance(hook, tuple) else (hook, None)
        self.rows = rows  # the batch's: a draw over them is over a part's
        self.leading: list[list[Any]] = []  # per part, each loss's first axis
        self.gathers = False  # the step called towers.gather
        self._losses: list[tf.Tensor] | None = None
        self._leading: list[Any] = []  # the part's, while traced
        self._drawn: dict[Any, list] = {}  # a trace's draws, by its parts' rows
        self._traced: Any = None  # a part's work, as a tf.function
        self._whole: Any = None  # the two examples' rows
        self.relaxed = False  # while traced for parts of any rows
        self.drawn: list[list[Any]] = []  # per part, its draws' row counts
        self._batch: list[tf.Tensor] = []
        self._raw: dict[int, tf.Tensor] = {}  # raw tf.Variables' (_stateless)

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
                self._traced = tf.function(self._part, autograph=False)
                self._relax(parts)
            try:
                out = self.run(*parts)
            except ValueError as error:
                self._traced = None
                failed = failed or error
                if places.learn(self.model, self.hook, None) and reading:
                    continue  # read as blocks
                raise failed from (None if failed is error else error)
            places.learn(self.model, self.hook, self.drawn)
            return out
        raise AssertionError("both readings returned or raised")

    def _relax(self, parts: list[tuple]) -> None:
        """Traces the work once for parts of any rows, where every leaf has
        the two examples' rows and the work draws nothing (a draw's place in
        one device's draw needs the parts' rows). Else, or where that trace
        fails, each part's shape is traced at its first call."""
        sizes = {places.size_of(v) for v in tf.nest.flatten(parts[0]) if v is not None}
        if len(sizes) != 1 or None in sizes:
            return  # leaves of other rows: each part's shape traced apart
        self._whole = sizes.pop()

        def relaxed(leaf: Any) -> Any:
            if leaf is None:
                return None
            return tf.TensorSpec([None, *leaf.shape[1:]], leaf.dtype)

        spec = tf.nest.map_structure(relaxed, parts[0])
        self.relaxed = True  # a draw stops it (places.RowsUnknown)
        try:
            with self._routed():
                self._traced.get_concrete_function(spec, tf.TensorSpec([], tf.int32))
        except Exception:  # noqa: BLE001  the parts' own traces say what
            self._traced = tf.function(self._part, autograph=False)
            return
        finally:
            self.relaxed = False
        self._drawn = {self._whole: [], self._whole // 2: []}

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        """Within, the work's gradients, applies and draws are the probe's."""
        steady = Steady(self.model)
        with setting(recorder=self):
            with routed_gradients(self._gradient), routed_applies(nothing):
                drawing = draws.drawing(None, [self.model], 2, self.hook)
                raw = Patch(lambda: _stateless(self.model, self._raw)).applied()
                with drawing, places.steady(), steady.patched(), raw:
                    yield

    def run(self, *parts: tuple) -> tuple:
        """Each part's losses, numbers and kept outputs; one trace serves
        the parts of one shape (each example alone), or of every shape
        (:meth:`_relax`)."""
        out, logs, kept = [], [], []
        self.drawn, self.leading = [], []
        self._whole = places.size_of(parts[0][0])
        with self._routed():
            for part, first in zip(parts, (0, 0, 1)):
                losses, leading, numbers, outputs = self._traced(
                    part, tf.constant(first)
                )
                self.leading.append([int(n) if n >= 0 else None for n in leading])
                self.drawn.append(self._drawn[places.size_of(part[0])])
                out, logs = out + [losses], logs + [numbers]
                kept += outputs
        keys = set.intersection(*(set(numbers) for numbers in logs))
        logs = [{k: v for k, v in numbers.items() if k in keys} for numbers in logs]
        return out, logs, kept

    def _part(self, part: tuple, first: tf.Tensor) -> tuple:
        """The work on ``part``, the two examples' units from ``first`` on
        (0 and a part of two: both); with each loss's first axis (-1: none)."""
        (x, y, sw), work = part, self.work or own_hook(self.model, self.hook)
        kept = getattr(work, "kept", [])
        del kept[:]
        self._losses, self._leading, self._raw = [], [], {}
        self._batch = tf.nest.flatten(part, True)
        at = first * examples_of(x)  # its first row of the two examples'
        # Every variable mapped: a weight regulariser reads it through the scope.
        mapping = [(v, v.value) for v in self.model.variables]
        scope = keras.StatelessScope(mapping, collect_losses=True)
        with scope, places.rows_of(part, at, self._whole, self.rows) as tower:
            returned = work(keras.utils.pack_x_y_sample_weight(x, y, sw))
            self._drawn[places.size_of(x)] = list(tower.drawn)
        leading = tf.stack(self._leading) if self._leading else tf.zeros([0], tf.int32)
        return self._losses, leading, self._numbers(returned), list(kept)

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
        self._leading.append(tf.shape(loss)[0] if loss.shape.rank else -1)
        free = batch_free(loss, self._batch) if loss.shape.rank == 0 else None
        self._losses.append(_with_free(tf.reduce_sum(loss), free))
        flat = tf.nest.flatten(sources)
        if flat and all(isinstance(v, (tf.Variable, keras.Variable)) for v in flat):
            # Only losses are read: no backward pass traced for the weights
            # (a tensor's gradient is taken: WGAN-GP's penalty reads it).
            return tf.nest.map_structure(lambda v: tf.zeros(v.shape, v.dtype), sources)
        return own(target)


def _with_free(value: tf.Tensor, free: tf.Tensor | None) -> tf.Tensor:
    """``[value, its batch-free terms]`` (0 for none), float64."""
    free = tf.zeros_like(value) if free is None else free
    return tf.cast(tf.stack([value, tf.cast(free, value.dtype)]), tf.float64)


def _stateless(model: keras.Model, values: dict[int, tf.Tensor]) -> list[tuple]:
    """The model's raw tf.Variables as a StatelessScope holds Keras': an
    assignment kept in ``values`` (by id), read back after, nothing written."""
    raw = [v for v, _ in raw_variables(model)]

    def reading(variable: tf.Variable) -> Callable[[], tf.Tensor]:
        read = type(variable).value.__get__(variable)
        return lambda: values[id(variable)] if id(variable) in values else read()

    def kept(variable: tf.Variable, value: tf.Tensor) -> tf.Tensor:
        values[id(variable)] = value
        return value

    reads = [(v, name, reading(v)) for v in raw for name in ("value", "read_value")]
    return reads + raw_assignments(raw, kept)

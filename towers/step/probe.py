"""The one probe: how a step's tower work reads its batch, found before the
first step.

The work runs on two examples together and on each alone, traced once for
parts of any rows (once per part's shape where it draws) and run, nothing
applied or kept: a model's own ``train_step`` or ``test_step``
(:func:`probe`), or the built-in step's forward pass and its loss terms
(:func:`probe_terms`). Each number is read less its terms that read no
example (``loss_kinds.batch_free``, read from its graph): a mean takes the
mean of its values alone, a sum their sum; one that is neither couples the
examples (a contrastive loss, a variance over the batch), gathered or
refused by name before any update (``coupled.py``, ``custom.py``).

Every draw takes its rows of the two examples' draw (``places.py``), and
BatchNormalization normalises with its moving moments (``batchnorm.Steady``).
The built-in step's forward pass runs in inference mode: terms a layer adds
only in training (keras_hub's mixture-of-experts blocks) are known by their
class (``coupled.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras import call_model, compute_loss, layers_of, own_losses
from towers._keras.current import setting, this_tower
from towers._keras.patches import routed_applies, routed_gradients
from towers.split import examples_of, take_rows, units_of
from towers.step import draws, places
from towers.step.batchnorm import Steady
from towers.step.loss_kinds import (
    PROBE_ATOL,
    Kind,
    batch_free,
    kind_of,
    less_free,
    may_add_terms,
    nothing,
    readings,
    rows_match,
)

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


@dataclasses.dataclass
class Probed:
    """What :func:`probe_terms` found: the terms neither a mean nor a sum
    over the examples (``coupled``); the ``add_loss`` terms that sum over
    them, as ``(layer path, index)`` (each tower's adds up to the batch's
    unweighted); whether the outputs on two examples are not the outputs
    on each alone (the forward pass couples them: SigLIP's logits)."""

    coupled: list[Measured]
    sums: list[tuple[str, int]]
    outputs_coupled: bool = False


def probe(model: keras.Model, batch: tuple, hook: Any = "train_step") -> Found:
    """How ``hook`` reads ``batch``: the model's ``train_step`` or
    ``test_step`` by name, or a function of the packed data (``(name,
    work)``) returning numbers by key (and, in ``work.kept``, what to keep).
    A loss with a value per example is a sum (the tape sums it); a vector of
    another length (a mean per output) is read as its sum.

    Raises:
      ValueError: a loss that is neither a mean nor a sum over the examples.
    """
    size = units_of(batch)[0]  # a part's rows each (towers/split.py)
    if size < 2:
        return Found(None, {})
    recorder = _Recorder(model, hook, places.size_of(batch[0]))
    kinds: list[Any] = []
    found = Found([], {})
    for first in range(0, min(size - 1, 2 * PAIRS), 2):
        parts = [_rows(batch, first, first + 2)]
        parts += [_rows(batch, first + i, first + i + 1) for i in (0, 1)]
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


def probe_terms(
    model: keras.Model,
    batch: tuple[Any, Any, Any],
    own_loss: bool,
    device: str,
    training: bool = True,
) -> Probed:
    """The built-in step's loss terms that are not a mean over the examples
    of ``batch`` (x, y, sample_weight), by :func:`probe` on ``device``:
    every layer's ``add_loss`` terms and, with ``own_loss``, the model's
    ``compute_loss`` (called with ``training``: True as Keras' fit calls it,
    False as its evaluate does). An ``add_loss`` term that sums over the
    examples is a sum (each tower's adds up to one device's, unweighted); a
    ``compute_loss`` that sums couples them (it is weighted by the shares).

    A model of Keras' own layers only, none with an activity regulariser,
    and no ``compute_loss`` of its own adds no term: it is not called.

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> probe_terms(model, (np.ones((3, 2)), None, None), False, "/CPU:0")
    Probed(coupled=[], sums=[], outputs_coupled=False)
    """
    if not own_loss and not may_add_terms(model):
        return Probed([], [])
    keys: dict[str, tuple] = {}

    def terms(data: Any) -> dict[str, tf.Tensor]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = call_model(model, x, False)
        terms.kept.append(y_pred)
        values = {}
        for layer in layers_of(model):
            own = own_losses(layer)
            for i, term in enumerate(own):
                key = f"layer {layer.path}'s add_loss term" + f" {i}" * (len(own) > 1)
                keys[key], values[key] = (layer.path, i), tf.reduce_sum(term)
        if own_loss:
            loss = compute_loss(model, x, y, y_pred, sample_weight, training)
            values[f"{type(model).__name__}.compute_loss"] = loss
        return values

    terms.kept = []
    with tf.device(device):
        found = probe(model, batch, ("call", terms))
    if found.losses is None:
        return Probed([], [])
    probed = Probed([], [], not rows_match(*found.outputs))
    for key, measured in found.measured.items():
        sums = found.logs.get(key) in ("sum", "whole_sum")
        if key in keys and sums:
            probed.sums.append(keys[key])
        elif sums or key in found.neither:  # a compute_loss that sums: weighted
            probed.coupled.append(
                dataclasses.replace(measured, own_loss=key not in keys)
            )
    return probed


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
                named = misfit(self.model, self.hook, failed)
                if named is None:
                    raise failed from (None if failed is error else error)
                raise named from failed
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
                with drawing, places.steady(), steady.patched():
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
        (x, y, sw), work = part, self.work or getattr(self.model, self.hook)
        kept = getattr(work, "kept", [])
        del kept[:]
        self._losses, self._leading = [], []
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

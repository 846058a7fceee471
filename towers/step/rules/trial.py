"""The probe's trial: a tower's work run on three parts of a batch (two
examples together, then each alone), traced once for parts of any rows
where it draws nothing, nothing applied or kept; per part, each loss it
takes the gradient of and each number it returns, less their terms that
read no example (``loss_kinds.batch_free``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras.current import setting
from towers._keras.patches import (
    Patch,
    raw_assignments,
    routed_applies,
    routed_gradients,
)
from towers.split import examples_of
from towers.step.rules import draws, places
from towers.step.rules.batchnorm import Steady
from towers.step.rules.loss_kinds import batch_free, nothing
from towers.step.rules.state import raw_variables
from towers.step.work.hooks import own_hook


class Trial:
    """The work run on each of three parts (two examples, then each alone),
    nothing applied or kept; per part, each loss it takes the gradient of
    and each number it returns, less their batch-free terms."""

    def __init__(
        self, model: keras.Model, hook: Any, rows: int | None, learned: places.Learned
    ):
        self.model, self.learned = model, learned
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
                places.learn(self.learned, self.hook, None, reading)
                self._traced = tf.function(self._part, autograph=False)
                self._relax(parts)
            try:
                out = self.run(*parts)
            except ValueError as error:
                self._traced = None
                failed = failed or error
                if places.learn(self.learned, self.hook, None) and reading:
                    continue  # read as blocks
                raise failed from (None if failed is error else error)
            places.learn(self.learned, self.hook, self.drawn)
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
        with setting(trial=self):
            with routed_gradients(self._gradient), routed_applies(nothing):
                drawing = draws.drawing(None, [self.model], 2, self.hook, self.learned)
                raw = Patch(lambda: stateless(self.model, self._raw)).applied()
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
                numbers[key] = with_free(value, batch_free(value, self._batch))
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
        self._losses.append(with_free(tf.reduce_sum(loss), free))
        flat = tf.nest.flatten(sources)
        if flat and all(isinstance(v, (tf.Variable, keras.Variable)) for v in flat):
            # Only losses are read: no backward pass traced for the weights
            # (a tensor's gradient is taken: WGAN-GP's penalty reads it).
            return tf.nest.map_structure(lambda v: tf.zeros(v.shape, v.dtype), sources)
        return own(target)


def with_free(value: tf.Tensor, free: tf.Tensor | None) -> tf.Tensor:
    """``[value, its batch-free terms]`` (0 for none), float64."""
    free = tf.zeros_like(value) if free is None else free
    return tf.cast(tf.stack([value, tf.cast(free, value.dtype)]), tf.float64)


def stateless(model: keras.Model, values: dict[int, tf.Tensor]) -> list[tuple]:
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

"""Where a tower's draw sits in one device's draw of the batch.

A tower draws as rows ``[first, first + n_t)`` of the batch (:func:`rows`),
of each part of its data: :func:`place` reads a draw's row count as one
part's rows or k blocks of them, and names once a model a draw it cannot
place. In a cluster the rows follow the workers' before (:func:`placing`).
A tower's trace draws from Python's ``random`` as one device's would."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from towers._keras.current import IDLE, TracedStep, setting, this_tower
from towers._keras.patches import python_random_from
from towers.cluster.workers import Workers
from towers.split import examples_of
from towers.step.rules.forms import static_dim


def _here() -> TracedStep:
    # The step this thread's tower is traced in (placing).
    return this_tower().step or IDLE


@dataclasses.dataclass
class Learned:
    """What an engine's runner learned of its model's draws, kept across its
    steps' traces: by hook, how a draw over a number of rows that is both the
    batch's and k blocks of the shard's reads it, in call order (True: as the
    batch's, a fixed batch_size; False: as blocks, ``2 * ops.shape(x)[0]``; a
    bool for all), learned by the probe, whose parts differ in rows; the hooks
    asked for one with none learned; the draws named, with why (warned once)."""

    readings: dict[str, Any] = dataclasses.field(default_factory=dict)
    unlearned: set[str] = dataclasses.field(default_factory=set)
    named: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    def draws_named(self) -> list[str]:
        """The draws named so far."""
        return sorted({draw for draw, _ in self.named})


class RowsUnknown(Exception):
    """A draw in the probe's trace for parts of any rows, whose place only the
    parts' own rows tell (``trial.Trial``)."""


@contextlib.contextmanager
def rows(
    size: Any, first: Any, total: Any = None, others: Any = (), batch: Any = None
) -> Iterator[Any]:
    """Within, this thread's tower (yielded) draws as rows ``[first, first +
    size)`` of the batch of ``total`` rows (``others``: the shard's rows of
    its parts of other sizes; ``batch``: the rows the step is written for, if
    not ``total``, as in the probe's parts)."""
    tower = this_tower()
    batch = total if batch is None else batch
    size = tf.compat.dimension_value(size)
    python = tower.python
    step = _here()
    if tower.rows is None and step.python is not None:  # a tower's trace
        python = random.Random()
        python.setstate(step.python)
    rows = (size, first, total, tuple(others), batch)
    with setting(rows=rows, python=python, drawn=[]) as here:
        yield here
    if python is not tower.python:
        step.python_end = step.python_end or python.getstate()


def rows_of(shard: Any, first: Any, total: Any = None, batch: Any = None) -> Any:
    """:func:`rows` for a tower's shard whose first row is ``first``."""
    size = size_of(shard)
    leaves = [leaf for leaf in tf.nest.flatten(shard) if leaf is not None]
    counts = {size_of(leaf) for leaf in leaves} - {size, None}
    return rows(size, first, total, sorted(counts) if size else (), batch)


def place(rows: Any, draw: str, shaped: bool = True) -> tuple | None:
    """Where a draw over ``rows`` rows sits in one device's: ``(size, first,
    total, k)`` of the shard's part it draws (k = 1) or k >= 2 blocks of its
    rows (fake and real rows' label noise); k = 0 where named; None for a
    draw of no part's rows, or a tower with the whole batch. A draw over the
    whole batch's rows given as a number (``shaped`` False: keras.io's DDIM's
    fixed ``batch_size``) is the shard's rows of one device's, unless the
    probe learned it reads blocks (:func:`learn`).

    >>> with rows(4, 8, total=16):  # a tower of rows 8-11 of 16
    ...     place(16, "normal", shaped=False), place(16, "normal")
    ((4, 8, 16, 1), (4, 8, 16, 4))
    """
    tower = this_tower()
    if getattr(tower.trial, "relaxed", False):
        raise RowsUnknown(draw)
    size, first, total, others, batch = tower.rows
    if has_whole_batch() and not steadied():  # as drawn
        return None
    rows = static_dim(rows)
    tower.drawn.append(rows)
    if not isinstance(rows, int):  # known when it runs: the shard's if its are
        unknown = rows is None or isinstance(rows, tf.Tensor)
        return (size, first, total, 1) if unknown and size is None else None
    if not shaped and isinstance(batch, int) and rows == batch != size:
        if not size or rows % size or _fixed(len(tower.drawn) - 1):
            return (size, first, total, 1)
    parts = [(size, first, total)] + [
        (n, first * n // size, None if total is None else total * n // size)
        for n in others
    ]
    sizes = [n for n, _, _ in parts]
    blocks = [n for n in sizes if n and rows and rows % n == 0 and rows != n]
    if rows in sizes:  # a part's rows, as a draw over them is: read so
        if blocks:
            name(draw, f"draws {rows} rows on a tower whose data's parts have "
                  f"{sorted(sizes)} rows: read as the part of {rows}'s rows; if "
                  "it draws over blocks of another part's, every tower's are "
                  "not one device's", "a part's")  # fmt: skip
        return (*parts[sizes.index(rows)], 1)
    if others and (blocks or rows == sum(sizes)):
        why = (
            f"draws {rows} rows on a tower whose data's parts have "
            f"{sorted(sizes)} rows: rows of more than one part, or blocks of "
            "one of them, whose place in one device's draw towers cannot tell"
        )
    elif not blocks:
        return None  # no part's rows: every tower's alike
    elif total is not None:
        return (size, first, total, rows // size)
    else:
        why = (
            f"draws {rows} rows on a tower of {size}: blocks of its rows, "
            "whose place in one device's draw needs the batch's rows, not "
            "known here (in a cluster: a seed generator not among the "
            "model's variables)"
        )
    name(draw, f"{why}; here every tower draws the same numbers, not one device's",
          "unplaced")  # fmt: skip
    return (size, first, total, 0)  # named, not placed


def _fixed(index: int) -> bool:
    # Whether the index-th draw reads such a number as the batch's (Learned).
    step = _here()
    reading = (
        True if step.learned is None else step.learned.readings.get(step.hook, True)
    )
    if isinstance(reading, bool):
        if step.learned is not None:
            step.learned.unlearned.add(step.hook)
        return reading
    return reading[index] if index < len(reading) else True


def learn(
    learned: Learned, hook: str, parts: list[list[Any]] | None, reading: bool = True
) -> bool:
    """Sets in ``learned`` how ``hook`` reads a number of rows both the batch's
    and blocks of the shard's: from each draw's row counts on the probe's
    ``parts``, or ``reading`` for all (``parts`` None). Returns whether the
    step last traced asked for one with none learned."""
    asked = hook in learned.unlearned
    learned.unlearned.discard(hook)
    if parts is None:
        learned.readings[hook] = reading
        return asked
    first, *others = parts
    learned.readings[hook] = [
        all(index < len(other) and other[index] == rows for other in others)
        for index, rows in enumerate(first)
    ]
    return asked


@contextlib.contextmanager
def steady() -> Iterator[None]:
    """Within (the probe), a draw towers cannot place is its distribution's
    middle, the same for every part: a loss's kind is found through it."""
    step = this_tower().step
    if step is None:
        with setting(step=TracedStep(steady=True)):
            yield
        return
    before, step.steady = step.steady, True
    try:
        yield
    finally:
        step.steady = before


def name(draw: str, why: str, reason: str = "") -> None:
    """Warns once an engine and ``reason`` that ``draw`` is not one device's."""
    learned = _here().learned
    if learned is None or (draw, reason) not in learned.named:
        if learned is not None:
            learned.named.add((draw, reason))
        warnings.warn(f"towers: a draw of the step, {draw}: {why}.", stacklevel=4)


def check_placed(draw: str, own: Callable[..., Any], args: tuple, kwargs: dict):
    """In a cluster whose model holds no seed generator, where nothing placed
    the workers' rows: refuses a per-row draw from Keras' global generator,
    and names one from a generator the model does not hold."""
    if not _here().unplaced:
        return
    if inspect.signature(own).bind(*args, **kwargs).arguments.get("seed") is not None:
        why = (
            "a value per example from a seed generator not among the model's "
            "variables (made outside its layers' and its own __init__): in a "
            "cluster towers cannot place a worker's rows, and every worker "
            "draws the same numbers, not one device's"
        )
        name(draw, why, "cluster")
        return
    raise ValueError(
        f"keras.random.{draw} with seed=None draws from Keras' global seed "
        "generator, whose rows towers cannot place in a cluster's global "
        "batch; received one with a value per example in a worker's step, "
        "in a model with no seed generator of its own. Give the layer a "
        "keras.random.SeedGenerator and pass it as seed=. Nothing was "
        "updated."
    )


@contextlib.contextmanager
def placing(
    workers: Workers | None,
    examples: Any,
    draw: bool,
    hook: str = "",
    learned: Learned | None = None,
) -> Iterator[None]:
    """Within, draws are ``hook``'s, read as ``learned`` says (None: as the
    batch's, named each time), and the batch has ``examples`` rows; in a
    cluster the towers' rows follow the workers' before (one small sum) where
    the towers ``draw``, and a draw from Keras' global generator is refused
    where they do not. Python's ``random`` gives each tower's trace what one
    device's would draw, left as the first tower's left it."""
    outer = _here()
    step = TracedStep(
        hook=hook, learned=learned, steady=outer.steady, warm_ups=outer.warm_ups
    )
    step.batch_rows = examples if workers is None else None
    if workers is not None and draw:
        step.worker_first, step.batch_rows = workers.first_row(examples)
    step.unplaced = workers is not None and not draw
    step.python = random.getstate()
    with setting(step=step), python_random_from(lambda: this_tower().python):
        yield
    if step.python_end is not None:
        random.setstate(step.python_end)


def batch_rows() -> Any:
    """The step's batch's rows (in a cluster, the global batch's; None: unknown)."""
    return _here().batch_rows


def has_whole_batch() -> bool:
    """Whether this thread's tower has the whole batch (one tower, no cluster):
    what it takes of its rows is one device's as it is."""
    rows = this_tower().rows
    return rows is not None and isinstance(rows[2], int) and rows[0] == rows[2]


def in_tower() -> bool:
    """Whether this thread is a tower's, its rows set."""
    return this_tower().rows is not None


def steadied() -> bool:
    """Whether the probe runs (:func:`steady`)."""
    return _here().steady


def first_rows(shards: Any) -> list[Any]:
    """Each tower's first row in the (global) batch: ints where known, else tensors."""
    sizes = shards.sizes or [examples_of(part) for part in shards.parts]
    before = _here().worker_first
    return [sum(sizes[:t], before) for t in range(len(sizes))]


def size_of(x: Any) -> int | None:
    """A shard's rows as traced (None: known when it runs)."""
    size = examples_of(x)
    return size if isinstance(size, int) else None

"""The input of ``fit``, ``evaluate`` and ``predict``: the data adapter Keras' own
fit picks for ``x`` (arrays, tensors and nests of them, pandas, ``tf.data``,
Python generators, ``keras.utils.PyDataset``), as a ``tf.data`` pipeline of
global batches, one pass over the data at a time.

What towers adds to Keras' adapters is a *position* a checkpoint can save, so a
killed run resumes at its batch (``towers/training/epochs.py``). How a pass is
positioned depends on the form:

- ``"iterator"``: arrays and ``tf.data``. The tf.data iterator's own checkpoint
  holds the position (a pipeline whose position cannot be saved, found when
  ``fit`` opens its first pass, becomes ``"replay"``). Arrays that ``fit``
  shuffles come in a new order every pass, a permutation that follows from a
  seed and the pass's number alone (``tf.random.experimental.index_shuffle``),
  so any pass is rebuilt exactly.
- ``"index"``: a ``PyDataset``, which is indexable. A pass is a list of batch
  indices (shuffled from the seed and the pass's number), and a resumed pass
  starts at its index: no batch is read twice or skipped.
- ``"replay"``: a Python generator (and a tf.data pipeline whose position
  cannot be saved): a resumed pass reads the batches already trained again and
  drops them, so the data must come in the same order every time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf

from towers._keras.inputs import (
    PyDatasetAdapter,
    adapter_dataset,
    array_tensors,
    examples_of,
    gather_rows,
    get_data_adapter,
    host_tensors,
    is_array_input,
    peeked_batch,
    train_validation_split,
)
from towers.training.fits import check_numbers, describe

Positioning = Literal["iterator", "index", "replay"]


@dataclasses.dataclass
class Source:
    """One input of a fit, evaluate or predict call: its passes as tf.data.

    Attributes:
      adapter: the Keras data adapter Keras' fit picks for the input.
      positioning: how a pass is resumed (see the module's docstring).
      num_batches: batches in one pass, None when unknown (a generator, an
        infinite or filtered dataset, an infinite ``PyDataset``).
      make_pass: ``(pass number, first batch) -> the pass's batches``; only an
        ``"index"`` source starts a pass past batch 0.
      sample: one batch, to build a lazily built model from (read without
        moving any pass).
      spec: the batches' ``tf.TensorSpec`` nest (a pass's element spec), to
        build the compiled metrics from; nothing is read for it that a pass
        would not read.
      why_replay: for a ``"replay"`` source, why it cannot be positioned.
      seeded: whether the passes are shuffled from ``seed``.
      seed: the shuffle seed of arrays and a ``PyDataset``, set before the
        first pass (``fit`` draws it, or takes a checkpoint's).
      epoch_begin, epoch_end: the hooks Keras' ``EpochIterator`` calls around
        each epoch (a ``PyDataset``'s own ``on_epoch_begin``/``on_epoch_end``).
      class_weight: ``fit``'s, which Keras' adapter maps onto each batch as
        it is read (not up front, as for arrays): an error there names it.
    """

    adapter: Any
    positioning: Positioning
    num_batches: int | None
    make_pass: Callable[[int, int], tf.data.Dataset]
    sample: Callable[[], Any]
    spec: Callable[[], Any] = lambda: None
    why_replay: str | None = None
    seeded: bool = False
    seed: int | None = None
    epoch_begin: Callable[[], None] = lambda: None
    epoch_end: Callable[[], None] = lambda: None
    class_weight: Mapping[int, float] | None = None


def source_of(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    steps: int | None = None,
    shuffle: bool = False,
    class_weight: Mapping[int, float] | None = None,
    argument: str = "",
) -> Source:
    """The :class:`Source` of Keras-form input, through Keras' own adapter.

    Args:
      x, y, sample_weight, batch_size, class_weight: as Keras' ``fit`` takes
        them. ``y`` and ``sample_weight`` go with arrays only; a dataset,
        generator or ``PyDataset`` carries its own (Keras' errors say so).
      steps: ``steps_per_epoch`` (or ``steps``): with arrays and no
        ``batch_size``, Keras sizes the batches to cover the data in them.
      shuffle: whether the passes of arrays and a ``PyDataset`` are shuffled
        (from ``Source.seed``, which the caller sets before the first pass);
        a dataset or generator comes as it is, with Keras' warning.
      argument: how errors name the input (``"validation_data's "``).

    Raises:
      ValueError: Keras' own errors for input its fit refuses; a
        ``batch_size`` that is not a positive integer; arrays of strings;
        no examples (empty arrays or a dataset of 0 batches).

    Example:
      >>> source = source_of(np.zeros((5, 2)), np.ones(5), batch_size=2)
      >>> source.positioning, source.num_batches
      ('iterator', 3)
      >>> [len(x) for x, y in source.make_pass(0, 0)]
      [2, 2, 1]
    """
    if batch_size is not None:
        check_batch_size(batch_size)
    if isinstance(x, keras.utils.PyDataset):
        return _py_dataset_source(x, y, sample_weight, shuffle, class_weight)
    arrays = is_array_input((x, y, sample_weight))
    if arrays and sample_weight is not None and y is None:
        raise ValueError("sample_weight weighs targets; received it with y=None")
    check_numbers((x, y, sample_weight), argument)
    # Arrays are shuffled here (seeded, by pass), not by the adapter.
    adapter = get_data_adapter(
        x, y, sample_weight, batch_size, steps, shuffle and not arrays, class_weight
    )
    if arrays:
        if not examples_of(adapter):
            raise ValueError(
                f"{argument}x holds no examples: received "
                f"{describe(x, argument + 'x')}; at least one is needed"
            )
        return _array_source(adapter, shuffle)
    # Input is prepared on the host while the towers compute the step before.
    dataset = adapter.get_tf_dataset().prefetch(tf.data.AUTOTUNE)
    if isinstance(x, tf.data.Dataset) and dataset.cardinality() == 0:
        raise ValueError(
            f"{argument}x holds no examples: received a dataset of 0 batches"
        )
    # A tf.data pipeline's position is tried on its first pass's iterator
    # (fit, with checkpoints): an iterator made only to try it would take a
    # reshuffling pipeline's next seed, which its checkpoint then saves.
    why = None
    sample = lambda: next(iter(dataset))  # noqa: E731
    if not isinstance(x, tf.data.Dataset):
        why = "a Python generator's position cannot be saved"
        sample = lambda: peeked_batch(adapter)  # noqa: E731
    return Source(
        adapter,
        "replay" if why else "iterator",
        adapter.num_batches,
        lambda number, first: dataset,
        sample,
        lambda: dataset.element_spec,
        why_replay=why,
        epoch_begin=adapter.on_epoch_begin,
        epoch_end=adapter.on_epoch_end,
        class_weight=class_weight,
    )


def _array_source(adapter: Any, shuffle: bool) -> Source:
    if not shuffle:
        dataset = adapter.get_tf_dataset()
        return Source(
            adapter,
            "iterator",
            adapter.num_batches,
            lambda number, first: dataset,
            lambda: next(iter(dataset)),
            lambda: dataset.element_spec,
        )
    # Converted once: every pass gathers from the same tensors.
    arrays = host_tensors(array_tensors(adapter))
    last = examples_of(adapter) - 1
    source = Source(adapter, "iterator", adapter.num_batches, None, None, seeded=True)

    def make_pass(number: int, first: int) -> tf.data.Dataset:
        seed = tf.constant([source.seed, number], tf.int64)

        def rows(positions: tf.Tensor) -> Any:
            return gather_rows(
                arrays, tf.random.experimental.index_shuffle(positions, seed, last)
            )

        positions = tf.data.Dataset.range(last + 1).batch(adapter.batch_size)
        return positions.map(rows).prefetch(tf.data.AUTOTUNE)

    source.make_pass = make_pass
    source.sample = lambda: gather_rows(arrays, tf.range(1, dtype=tf.int64))
    source.spec = lambda: tf.nest.map_structure(
        _any_batch, tf.data.Dataset.from_tensors(source.sample()).element_spec
    )
    return source


def _any_batch(spec: Any) -> Any:
    """A dense batch's spec with its first (batch) dimension unknown."""
    if isinstance(spec, tf.TensorSpec):
        return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
    return spec


def _py_dataset_source(
    data: keras.utils.PyDataset, y, sample_weight, shuffle, class_weight
) -> Source:
    """A PyDataset through Keras' ``PyDatasetAdapter``: each pass its own
    adapter over the pass's batch indices (``Indexed``), so a pass can start at
    any of them, and its workers (threads or processes) serve that pass alone."""
    # Keras' own checks: y and sample_weight with a PyDataset are refused.
    first = get_data_adapter(data, y, sample_weight, None, None, False, class_weight)
    total = data.num_batches
    source = Source(first, "index", total, None, lambda: data[0])
    source.seeded = bool(shuffle) and total is not None
    source.epoch_begin, source.epoch_end = data.on_epoch_begin, data.on_epoch_end

    def make_pass(number: int, start: int) -> tf.data.Dataset:
        if total is None:
            order = None
        elif shuffle:
            order = _permutation(source.seed, number, total)
        else:
            order = np.arange(total)
        adapter = PyDatasetAdapter(Indexed(data, order, start), class_weight)
        return adapter_dataset(adapter, like=first)

    source.make_pass = make_pass
    source.spec = lambda: adapter_dataset(first, like=first).element_spec
    return source


class Indexed(keras.utils.PyDataset):
    """A ``PyDataset`` read in a given order of its batch indices (None: 0, 1,
    ... for an infinite one), from position ``start`` of it on. Its workers,
    multiprocessing and queue are the wrapped dataset's; the epoch hooks are
    the caller's to call on the wrapped dataset (once per epoch, not per pass).

    >>> class Squares(keras.utils.PyDataset):
    ...     def __len__(self): return 4
    ...     def __getitem__(self, i): return np.array([i * i])
    >>> part = Indexed(Squares(), np.array([3, 1, 0, 2]), start=1)
    >>> part.num_batches, [int(part[i][0]) for i in range(part.num_batches)]
    (3, [1, 0, 4])
    """

    def __init__(self, data: keras.utils.PyDataset, order: Any, start: int = 0):
        super().__init__(
            workers=data.workers,
            use_multiprocessing=data.use_multiprocessing,
            max_queue_size=data.max_queue_size,
        )
        self.data, self.order, self.start = data, order, start

    def __getitem__(self, index: int) -> Any:
        if self.order is None:
            return self.data[self.start + index]
        return self.data[int(self.order[self.start + index])]

    def __len__(self) -> int:
        return len(self.order) - self.start

    @property
    def num_batches(self) -> int | None:
        return None if self.order is None else len(self)


def _permutation(seed: int, number: int, total: int) -> np.ndarray:
    """Pass ``number``'s order of ``total`` batches, from ``seed`` alone."""
    positions = tf.range(total, dtype=tf.int64)
    key = tf.constant([seed, number], tf.int64)
    return tf.random.experimental.index_shuffle(positions, key, total - 1).numpy()


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple:
    """``fit(validation_split=fraction)``: ``(x, y, sample_weight,
    validation_data)``, the last ``fraction`` of the examples held out by Keras'
    own split (before any shuffling).

    Raises:
      ValueError: input other than arrays (it cannot be split), or too few
        examples to split.

    Example:
      >>> x, y, _, (vx, vy, _) = split_validation(np.arange(10), np.arange(10),
      ...                                         None, 0.2)
      >>> x.tolist(), vx.tolist()
      ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    """
    if not is_array_input((x, y, sample_weight)):
        raise ValueError(
            "validation_split is for array input; received "
            f"{type(x).__name__}. Pass validation_data instead."
        )
    (x, y, sample_weight), validation = train_validation_split(
        (x, y, sample_weight), validation_split=fraction
    )
    return x, y, sample_weight, validation


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """A batch as ``(x, y, sample_weight)``, None for what it lacks.

    >>> unpack((1, 2))
    (1, 2, None)

    An optional input a generator gave as None arrives as an empty
    ``tf.experimental.Optional``: None again, as Keras' step converts it.
    """
    batch = tf.nest.map_structure(
        lambda i: None if isinstance(i, tf.experimental.Optional) else i, batch
    )
    return keras.utils.unpack_x_y_sample_weight(batch)


def check_batch_size(batch_size: Any) -> int:
    """A given batch size, refused unless a positive integer.

    >>> check_batch_size(8)
    8
    """
    if (
        not isinstance(batch_size, (int, np.integer))
        or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(
            f"batch_size must be a positive integer; received batch_size={batch_size!r}"
        )
    return int(batch_size)

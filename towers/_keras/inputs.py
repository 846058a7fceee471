"""The non-public parts of Keras towers' input uses (``training/inputs.py``,
``training/epochs.py``, ``training/run.py``): Keras' data adapters (converted
arrays gathered in towers' seeded order, sparse ones through Keras' wrapper of
their rows; a ``PyDatasetAdapter`` handed the first pass's signature), the
validation split, ``EpochIterator``'s rules and warning,
``BackupAndRestore``'s ``_initial_epoch``; ``Progbar`` rewriting its line only
on a terminal; predict's batches joined as Keras' predict joins them
(``potentially_ragged_concat``). Data that does not fit the model is run
through it by shapes for Keras' own error (``backend.compute_output_spec``,
in ``towers/_keras/__init__.py``).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import (
    convert_to_np_if_not_ragged,
    potentially_ragged_concat,
)
from keras.src.trainers.data_adapters import data_adapter_utils, get_data_adapter
from keras.src.trainers.data_adapters.array_data_adapter import can_convert_arrays
from keras.src.trainers.data_adapters.array_slicing import (
    TensorflowSparseWrapper,
    convert_to_sliceable,
    slice_tensorflow_sparse_wrapper,
    train_validation_split,
)
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
from keras.src.trainers.epoch_iterator import EpochIterator

# Imported here for the modules that use them.
__all__ = [
    "PyDatasetAdapter",
    "convert_to_np_if_not_ragged",
    "get_data_adapter",
    "potentially_ragged_concat",
    "train_validation_split",
]


def is_array_input(data: Any) -> bool:
    """Whether Keras' fit reads ``data`` (a nest) as arrays: NumPy, tensors,
    pandas, lists of them (its ``ArrayDataAdapter``).

    >>> is_array_input((np.zeros(3), None)), is_array_input(iter([1]))
    (True, False)
    """
    return can_convert_arrays(data)


def array_tensors(adapter: Any) -> Any:
    """An ``ArrayDataAdapter``'s data, packed as its batches are (``(x,)``,
    ``(x, y)`` or ``(x, y, sample_weight)``, class weights applied), converted
    for tf.data, lists as tuples."""
    return keras.tree.lists_to_tuples(
        convert_to_sliceable(adapter._inputs, target_backend="tensorflow")
    )


NESTS = (list, tuple, dict)  # traversed into by keras.tree.traverse


def gather_rows(data: Any, rows: Any) -> Any:
    """Examples ``rows`` of an ``ArrayDataAdapter``'s data (as
    :func:`array_tensors` gives it), as Keras' adapter takes each batch:
    tensors gathered, sparse ones through Keras' wrapper of their rows."""

    def grab(leaf: Any) -> Any:
        if isinstance(leaf, TensorflowSparseWrapper):
            return slice_tensorflow_sparse_wrapper(leaf, rows)
        if isinstance(leaf, NESTS):
            return None
        if tf.is_tensor(leaf):
            return tf.gather(leaf, rows, axis=0)
        return leaf

    return keras.tree.traverse(grab, data)


def host_tensors(data: Any) -> Any:
    """:func:`array_tensors`' data with its arrays as tensors (sparse and
    ragged tensors, and Keras' wrappers of sparse ones, as they are)."""

    def convert(leaf: Any) -> Any:
        if leaf is None or isinstance(leaf, (TensorflowSparseWrapper, *NESTS)):
            return None  # None: an optional input given none, kept
        if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)):
            return leaf
        return tf.convert_to_tensor(leaf)

    return keras.tree.traverse(convert, data)


def examples_of(adapter: Any) -> int:
    return int(adapter._num_samples)  # an ArrayDataAdapter's examples


def adapter_dataset(adapter: PyDatasetAdapter, like: PyDatasetAdapter) -> Any:
    """``adapter``'s tf.data pipeline with the element signature ``like``
    found (or finds now), so the batches it reads for it are read once."""
    if like._output_signature is None:
        like.get_tf_dataset()
    adapter._output_signature = like._output_signature
    return adapter.get_tf_dataset()


def warn_ran_out() -> None:
    """Keras' warning for input that ran out within an epoch."""
    EpochIterator._interrupted_warning(None)


def initial_epoch(model: keras.Model, forget: bool = False) -> int | None:
    """The epoch ``keras.callbacks.BackupAndRestore`` restored to start at (it
    sets it in ``on_train_begin``), or None; ``forget``: cleared after, as
    Keras' fit clears it at its end."""
    epoch = getattr(model, "_initial_epoch", None)
    if forget:
        model._initial_epoch = None
    return epoch


def peeked_batch(adapter: Any) -> Any:
    """A generator's first batch, which Keras' adapter read to find the
    batches' signature (reading the generator again would move it on), its
    scipy and jax sparse arrays as TensorFlow's, as the adapter's pipeline
    gives them."""

    def as_tf(leaf: Any) -> Any:
        if data_adapter_utils.is_scipy_sparse(leaf):
            return data_adapter_utils.scipy_sparse_to_tf_sparse(leaf)
        if data_adapter_utils.is_jax_sparse(leaf):
            return data_adapter_utils.jax_sparse_to_tf_sparse(leaf)
        return leaf

    return keras.tree.map_structure(as_tf, adapter._first_batches[0])


def set_in_place(progbar: keras.utils.Progbar, in_place: bool) -> None:
    """Whether ``progbar`` rewrites its line (``\\r``) or writes new ones."""
    progbar._dynamic_display = in_place

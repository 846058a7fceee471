"""A step's batch on the host: its examples counted and checked, its parts
converted to tensors, one example taken to build a model from.

A batch is ``(x, y, sample_weight)``, each a tensor, an array or a nest of them
(y and sample_weight may be None), B examples on the first axis of every leaf.
A ``tf.SparseTensor`` or ``tf.RaggedTensor`` leaf counts its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from towers.split import COMPOSITES, batch_size_of, examples_of, take_rows

# Input arrives on the host and is split there, whatever the compute devices are.
HOST = "/device:CPU:0"


def check_sizes(
    x: Any, y: Any, sample_weight: Any, allow_empty: bool, apart: bool = False
) -> None:
    """Refuses parts that disagree on B, unless ``apart`` (a model's own step
    reads them itself: each is split in the same shares, ``towers/split.py``),
    and B == 0 unless ``allow_empty`` (a worker's share of a small batch may
    be empty: it joins with zeros).

    >>> check_sizes(np.zeros((3, 2)), np.zeros(2), None, allow_empty=False)
    Traceback (most recent call last):
    ...
    ValueError: x and y must have the same batch size; received x with 3 ...
    """
    parts = (("x", x), ("y", y), ("sample_weight", sample_weight))
    sizes = {
        name: (examples_of if apart else batch_size_of)(part)
        for name, part in parts
        if part is not None
    }
    if len(set(sizes.values())) > 1 and not apart:
        names = " and ".join(sizes)
        counts = [f"{name} with {n}" for name, n in sizes.items()]
        raise ValueError(
            f"{names} must have the same batch size; received {counts[0]} "
            f"examples and {' and '.join(counts[1:])}"
        )
    if sizes["x"] == 0 and not allow_empty:
        raise ValueError("a batch needs at least one example; received 0")


def on_host(batch: tuple) -> tuple:
    """The batch's leaves as tensors on the host (what tf.data gives, tensors,
    sparse and ragged ones included, stays as it is).

    >>> x, y, sw = on_host((np.ones((2, 3)), np.array([1, 2]), None))
    >>> x.dtype.name, y.shape.as_list(), sw
    ('float64', [2], None)
    """

    def tensor(leaf: Any) -> Any:
        if leaf is None or isinstance(leaf, (tf.Tensor, *COMPOSITES)):
            return leaf
        return tf.convert_to_tensor(leaf)

    with tf.device(HOST):
        return tuple(tf.nest.map_structure(tensor, part) for part in batch)


def first_example(x: Any) -> Any:
    """``x``'s first example, as a batch of one (to build a model from)."""
    return tf.nest.map_structure(lambda leaf: take_rows(leaf, 0, 1), x)


def check_targets(loss: Any, y: Any) -> None:
    """Refuses a training or evaluation batch without targets when ``loss``
    (a ``StepLoss``) compares predictions with them, naming the loss.

    >>> from towers.step.work.losses import StepLoss
    >>> check_targets(StepLoss("mse"), None)
    Traceback (most recent call last):
    ...
    ValueError: loss mse compares predictions with targets; received a batch ...
    """
    names = loss.output_names or []
    if isinstance(y, Mapping) and len(names) > 1:
        unknown = sorted(set(y) - set(names))
        missing = [n for n in loss.output_names_with_losses() if n not in y]
        if unknown or missing:
            raise ValueError(
                f"y as a dict needs a target for each output with a loss "
                f"({loss.output_names_with_losses()}), keyed by the model's output "
                f"names {names}; received keys {sorted(y)}"
                + (f": {unknown} name no output" if unknown else "")
                + (f"; missing {missing}" if missing else "")
            )
    name = None if y is not None else loss.needs_targets()
    if name is not None:
        raise ValueError(
            f"loss {name} compares predictions with targets; received a batch "
            "without targets (y=None). Pass y, or loss=None for a model that "
            "adds its own loss (add_loss)."
        )

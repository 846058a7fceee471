"""A per-output spec, as ``model.compile`` takes its loss, loss weights and
metrics, and as ``fit`` takes targets and sample weights: one value for every
output, a list in output order, or a dict by output name; a loss spec's
entries as Keras loss objects (:func:`as_loss`).

>>> entry({"a": 1.0, "b": 2.0}, "b", 1, repeat=True), entry(3.0, "b", 1, repeat=True)
(2.0, 3.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras

from towers._keras import LossFunctionWrapper, is_binary_or_sparse_categorical


def map_spec(fn, spec: Any) -> Any:
    """``fn`` applied to each entry of a loss spec: one, a list, or a dict."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return {key: fn(value) for key, value in spec.items()}
    if isinstance(spec, (list, tuple)):
        return [fn(value) for value in spec]
    return fn(spec)


def only(spec: Any, default: Any = None) -> Any:
    """The one entry of a spec for a model with one output."""
    if spec is None:
        return default
    if isinstance(spec, (Mapping, list, tuple)):
        values = list(spec.values()) if isinstance(spec, Mapping) else list(spec)
        if len(values) != 1:
            raise ValueError(
                f"the model has one output; received {len(values)} entries: {spec!r}"
            )
        return values[0]
    return spec


def entry(spec, name, i, repeat, default=None, what="", names=()):
    """Output ``i`` (named ``name``)'s entry of a list or dict; a single value
    is every output's when ``repeat``."""
    if spec is None:
        return default
    if isinstance(spec, Mapping):
        return spec.get(name, default)
    if isinstance(spec, (list, tuple)):
        return spec[i] if i < len(spec) else default
    if repeat or len(names) == 1:  # one output's, as Keras takes it
        return spec
    raise ValueError(
        f"the model has {len(names)} outputs {names}: {what} must be a list or a "
        f"dict with one entry per output; received a single {type(spec).__name__}"
    )


def targets_of(y: Any, names: list[str], with_loss: list[int]) -> Any:
    """The targets by output, as Keras' compiled loss reads them when only
    some outputs have a loss: a single target, or a list as long as the
    outputs with a loss, goes to those outputs in order; anything else is
    returned as it is.

    >>> targets_of("t", ["a", "b", "c"], with_loss=[1])
    [None, 't', None]
    >>> targets_of(["t", "u"], ["a", "b", "c"], with_loss=[0, 2])
    ['t', None, 'u']
    """
    if isinstance(y, Mapping) or len(with_loss) == len(names):
        return y
    listed = isinstance(y, (list, tuple))
    if listed and len(y) == len(names):
        return y
    given = list(y) if listed else [y]
    if len(given) != len(with_loss):
        return y
    spread: list[Any] = [None] * len(names)
    for i, target in zip(with_loss, given):
        spread[i] = target
    return spread


def names_of(model: keras.Model) -> list[str] | None:
    """The model's output names as ``compile`` maps a dict of losses onto
    them: a dict output's keys (two keys may name one tensor), else Keras'
    ``output_names``; None for a model not built on symbolic outputs."""
    try:
        output = model.output
    except (AttributeError, ValueError):
        output = None
    if isinstance(output, Mapping):
        return list(output)
    return getattr(model, "output_names", None)


def output_names(y_pred: Any, names: list[str] | None) -> list[str]:
    if isinstance(y_pred, Mapping):
        return list(y_pred)
    if names and len(names) == len(y_pred):
        return names
    return [f"output_{i}" for i in range(len(y_pred))]


def check_keys(spec: Any, names: list[str], what: str) -> None:
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(
                f"{what} names outputs the model does not have; received "
                f"{unknown}, the model's outputs are {names}"
            )
    elif isinstance(spec, (list, tuple)) and len(spec) != len(names):
        raise ValueError(
            f"{what} must have one entry per output ({len(names)}: {names}); "
            f"received {len(spec)}"
        )


def check_weights(weights: Any, losses: Any) -> Any:
    if weights is None:
        return None
    flat = (
        list(weights.values())
        if isinstance(weights, Mapping)
        else list(weights)
        if isinstance(weights, (list, tuple))
        else [weights]
    )
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in flat):
        raise ValueError(f"loss_weights must be numbers; received {weights!r}")
    if losses is None:
        raise ValueError(
            f"loss_weights weigh losses; received {weights!r} with loss=None"
        )
    return weights


REDUCTIONS = (
    None,
    "none",
    "sum_over_batch_size",
    "mean",
    "mean_with_sample_weight",
    "sum",
)


class PerExample(keras.losses.Loss):
    """A function ``(y_true, y_pred) -> one value per example`` as a Keras
    loss: the mean over examples.

    >>> import numpy as np
    >>> float(PerExample(lambda y, p: abs(y - p))(np.ones(4), np.zeros(4)))
    1.0
    """

    def __init__(self, fn: Any, name: str | None = None):
        super().__init__(name=name or getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


class CrossentropyByShapes(keras.losses.Loss):
    """``"crossentropy"`` and ``"ce"``: binary, sparse categorical or
    categorical crossentropy, picked by the shapes as Keras' ``compile`` does.

    >>> ce = CrossentropyByShapes()
    >>> y, p = keras.ops.array([0, 1]), keras.ops.array([[0.8, 0.2], [0.4, 0.6]])
    >>> round(float(ce(y, p)), 4)  # sparse targets: sparse categorical
    0.367
    """

    def __init__(self, name: str = "crossentropy"):
        super().__init__(name=name)

    def call(self, y_true: Any, y_pred: Any) -> Any:
        binary, sparse = is_binary_or_sparse_categorical(y_true, y_pred)
        picked = (
            keras.losses.binary_crossentropy
            if binary
            else keras.losses.sparse_categorical_crossentropy
            if sparse
            else keras.losses.categorical_crossentropy
        )
        return LossFunctionWrapper(picked, name=self.name).call(y_true, y_pred)


def as_loss(loss: Any) -> keras.losses.Loss | None:
    if loss is None:
        return None
    if isinstance(loss, str) and loss.lower() in ("crossentropy", "ce"):
        return CrossentropyByShapes(name=loss)
    if isinstance(loss, str):
        name, loss = loss, keras.losses.get(loss)
        if not isinstance(loss, keras.losses.Loss):
            # As Keras' compile wraps a loss named by its function: targets
            # squeezed or expanded to the predictions' rank, then the function.
            loss = LossFunctionWrapper(loss, name=name)
    if isinstance(loss, keras.losses.Loss):
        if loss.reduction not in REDUCTIONS:
            raise ValueError(
                f"unsupported loss reduction {loss.reduction!r} on {loss.name}; "
                f"expected one of {['sum', *REDUCTIONS[:-1]]}"
            )
        return loss
    if callable(loss):
        return PerExample(loss)
    raise ValueError(
        "loss must be a keras.losses.Loss, a Keras loss name, or a function "
        f"(y_true, y_pred) -> per-example losses; received {loss!r}"
    )

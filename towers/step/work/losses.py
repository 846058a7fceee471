"""The user's loss as terms that T shards add up to exactly.

A Keras loss reduces over the batch it sees: ``S / D``, the weighted values
summed (``S``) over what its reduction divides by (``D``: the loss values for
``sum_over_batch_size``, the sample weights' sum for
``mean_with_sample_weight``, the valid entries under a mask, 1 for ``sum``).
``S`` and ``D`` add up over shards, their quotient does not; so each tower
computes a :class:`Term` per output and the step divides by ``sum_t D_t``::

    loss = sum_o weight_o * (sum_t S_to) / (sum_t D_to)   (+ the model's own losses)

which is Keras' value on the whole batch (``tests/step/work/test_losses.py``).
A loss that gives one value for the batch raises :class:`OneValue` while
the step is traced: the step then takes Keras' ``compute_loss`` of the
batch instead (``Step.whole_batch_loss``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import (
    apply_mask,
    get_keras_mask,
    squeeze_or_expand_to_same_rank,
)
from towers.step.rules.loss_kinds import Kind
from towers.step.work import outputs


@dataclasses.dataclass
class Term:
    """One output's loss on a tower's shard, before the reduction: ``total``
    (``S_t``, a scalar in the loss's dtype), ``divisor`` (``D_t``: a number
    where known at trace time, else a scalar tensor; None for a sum), the
    output's loss ``weight`` and ``name``; ``kind``: ``"mean"`` (``D_t`` is
    the shard's examples times a constant), ``"sum"`` or ``"global"``
    (``D_t`` from sample weights or a mask)."""

    total: tf.Tensor
    divisor: Any
    weight: float
    name: str
    kind: Kind


class StepLoss:
    """The user's loss, per output, as terms each tower computes on its shard.

    Args:
      loss: a ``keras.losses.Loss`` (any reduction), a Keras loss name, or a
        function ``(y_true, y_pred) -> one value per example``; a list
        (output order) or dict (output names) of those, None for an output
        without a loss; or None when the model adds its loss itself.
      loss_weights: None, or one number per loss, in the loss's structure.
      output_names: the model's output names, for a dict over list outputs.

    Raises:
      ValueError: an unknown loss or reduction, or weights that do not match
        the losses; the message names what was received.

    Example:
      >>> loss = StepLoss("mse")
      >>> y, p = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])
      >>> [term] = loss.terms(y[:1], p[:1], None)  # a tower with 1 of 2 examples
      >>> float(term.total), term.divisor, term.kind  # 1^2, over 1 example
      (1.0, 1, 'mean')
    """

    def __init__(
        self,
        loss: Any,
        loss_weights: Any = None,
        output_names: Sequence[str] | None = None,
    ):
        self.output_names = list(output_names) if output_names else None
        self.losses = outputs.map_spec(outputs.as_loss, loss)
        self.loss_weights = outputs.check_weights(loss_weights, self.losses)
        if self.output_names and len(self.output_names) > 1:
            # Known before any batch: a loss for an output the model lacks.
            outputs.check_keys(self.losses, self.output_names, "loss")
            outputs.check_keys(self.loss_weights, self.output_names, "loss_weights")

    def output_names_with_losses(self) -> list[str]:
        """The outputs with a loss of their own (a single output reports
        only ``loss``).

        >>> StepLoss({"a": "mse", "b": None}).output_names_with_losses()
        ['a']
        """
        if isinstance(self.losses, Mapping):
            names = self.output_names or list(self.losses)
            return [n for n in names if self.losses.get(n) is not None]
        names = self.output_names or []
        if isinstance(self.losses, (list, tuple)):
            return [n for n, loss in zip(names, self.losses) if loss is not None]
        return list(names) if self.losses is not None and len(names) > 1 else []

    def needs_targets(self) -> str | None:
        """The first loss that compares predictions with targets, or None.

        >>> StepLoss("mse").needs_targets(), StepLoss(None).needs_targets()
        ('mse', None)
        """
        losses = self.losses
        if isinstance(losses, Mapping):
            losses = list(losses.values())
        elif not isinstance(losses, (list, tuple)):
            losses = [losses]
        return next((loss.name for loss in losses if loss is not None), None)

    def terms(self, y_true: Any, y_pred: Any, sample_weight: Any) -> list[Term]:
        """This shard's terms, one per output that has a loss."""
        if self.losses is None:
            return []
        if not isinstance(y_pred, (Mapping, list, tuple)):
            single = outputs.only(self.losses)
            weight = outputs.only(self.loss_weights, default=1.0)
            return [_term(single, y_true, y_pred, sample_weight, weight, "loss")]
        names = outputs.output_names(y_pred, self.output_names)
        outputs.check_keys(self.losses, names, "loss")
        outputs.check_keys(self.loss_weights, names, "loss_weights")
        preds = list(y_pred.values()) if isinstance(y_pred, Mapping) else y_pred
        with_loss = [
            i
            for i, name in enumerate(names)
            if outputs.entry(self.losses, name, i, repeat=True) is not None
        ]
        y_true = outputs.targets_of(y_true, names, with_loss)
        terms = []
        for i, (name, pred) in enumerate(zip(names, preds)):
            loss = outputs.entry(self.losses, name, i, repeat=True)
            if loss is not None:
                y_t = outputs.entry(
                    y_true, name, i, repeat=False, what="y", names=names
                )
                weight = outputs.entry(
                    self.loss_weights, name, i, repeat=True, default=1.0
                )
                sw = outputs.entry(sample_weight, name, i, repeat=True)
                terms.append(_term(loss, y_t, pred, sw, weight, name))
        return terms


def _term(loss: keras.losses.Loss, y_true, y_pred, sample_weight, weight, name):
    # As loss(y_true, y_pred, sample_weight) computes it, stopped before the
    # reduction.
    if y_true is None:
        raise ValueError(
            f"loss {loss.name} compares predictions with targets; received a batch "
            "without targets (y=None). Pass y, or loss=None for a model that adds "
            "its own loss (add_loss)."
        )
    in_mask = get_keras_mask(y_pred)  # before a cast drops it
    y_pred = tf.nest.map_structure(lambda a: tf.cast(a, loss.dtype), y_pred)
    y_true = tf.nest.map_structure(lambda a: tf.cast(a, loss.dtype), y_true)
    try:
        values = loss.call(y_true, y_pred)
    except NotImplementedError as error:  # a Loss that overrides __call__ only
        raise OneValue(f"loss {loss.name} gives one value for the batch") from error
    values = _check_per_example(loss, tf.convert_to_tensor(values), y_pred)
    mask = _both(in_mask, get_keras_mask(values))
    # Weights and mask merged as for a "sum": the plain 0/1 mask, no rescaling.
    weights = apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    weighted = values
    if weights is not None:
        weighted, weights = squeeze_or_expand_to_same_rank(
            values, tf.cast(weights, values.dtype)
        )
        weighted = weighted * weights
    total = tf.cast(tf.reduce_sum(weighted), loss.dtype)  # Keras' dtype: floatx
    divisor, kind = _divisor(loss.reduction, weighted, weights, mask)
    return Term(total, divisor, float(weight), name, kind)


def _both(in_mask: Any, out_mask: Any) -> Any:
    if in_mask is not None and out_mask is not None:
        return in_mask & out_mask
    return in_mask if in_mask is not None else out_mask


def _divisor(reduction: Any, values: tf.Tensor, weights: Any, mask: Any):
    # What Keras' reduction divides the summed values by, and its kind.
    if reduction == "sum":
        return None, "sum"
    dtype = values.dtype
    if reduction == "mean_with_sample_weight" and weights is not None:
        return tf.reduce_sum(weights), "global"
    size = _size(values)
    if mask is None or reduction == "mean_with_sample_weight":
        return size, "mean"
    # Keras scales a mask by total / valid, so the mean is over the valid entries.
    mask = tf.cast(mask, dtype)
    return tf.cast(size, dtype) * tf.reduce_sum(mask) / tf.cast(
        tf.size(mask), dtype
    ), "global"


def _size(values: tf.Tensor) -> Any:  # an int where the shape is known
    if values.shape.is_fully_defined():
        return int(np.prod(values.shape.as_list()))
    return tf.cast(tf.size(values), values.dtype)


class OneValue(ValueError):
    """A loss gives one value for the batch, not one per example."""


def _check_per_example(loss: keras.losses.Loss, values: tf.Tensor, y_pred: Any):
    # One value per example (more for a Keras loss: per timestep); OneValue
    # for one value in all; else a ValueError naming the loss.
    if values.shape.rank == 0:
        raise OneValue(f"loss {loss.name} gives one value for the batch")
    examples = tf.nest.flatten(y_pred)[0].shape[0]
    strict = isinstance(loss, outputs.PerExample)
    rank_ok = values.shape.rank == 1 or (not strict and values.shape.rank)
    if values.shape.rank is not None and not rank_ok:
        raise ValueError(
            f"loss {loss.name} must return one value per example, shape "
            f"[{examples}]; received shape {values.shape}. Return per-example "
            "losses (e.g. a Keras loss with reduction=None), not their mean."
        )
    if isinstance(examples, int) and values.shape[0] is not None:
        if values.shape[0] != examples:
            raise ValueError(
                f"loss {loss.name} must return one value per example: "
                f"{examples} predictions gave {values.shape[0]} loss values"
            )
        return values
    check = tf.debugging.assert_equal(
        tf.shape(values)[0],
        tf.shape(tf.nest.flatten(y_pred)[0])[0],
        message=f"loss {loss.name} must return one value per example",
    )
    with tf.control_dependencies([check]):
        return tf.identity(values)


def step_kind(terms: list[Term], has_extra: bool) -> Kind:
    """How a step's loss reads its batch, from one tower's terms: a
    ``"mean"`` (every divisor the examples times a constant: a worker's or a
    micro-batch's loss, weighted by its examples, adds up to the batch's), a
    ``"sum"`` (no divisor, no model losses, which are means), else
    ``"global"`` (the step needs every divisor of the batch).

    >>> step_kind([], has_extra=True)  # a model that adds its own loss
    'mean'
    """
    kinds = {term.kind for term in terms}
    if kinds <= {"mean"}:
        return "mean"
    if kinds == {"sum"} and not has_extra:
        return "sum"
    return "global"


def step_divisors(tower_terms: list[list[Term]]) -> list[Any]:
    """Each term's divisor for the whole step: the towers' summed (a number
    where every one is), None for a sum.

    >>> t = [[Term(tf.constant(1.0), 3, 1.0, "loss", "mean")],
    ...      [Term(tf.constant(2.0), 2, 1.0, "loss", "mean")]]
    >>> step_divisors(t)
    [5]
    """
    divisors = []
    for per_tower in zip(*tower_terms):
        parts = [term.divisor for term in per_tower]
        if parts[0] is None:
            divisors.append(None)
        elif all(isinstance(d, (int, float)) for d in parts):
            divisors.append(sum(parts))
        else:
            dtype = per_tower[0].total.dtype
            divisors.append(tf.add_n([tf.cast(d, dtype) for d in parts]))
    return divisors


def over(value: Any, divisor: Any) -> Any:
    """``value / divisor`` in ``value``'s dtype, 0 over 0 (as Keras'
    reductions), ``value`` for no divisor."""
    if divisor is None:
        return value
    if isinstance(divisor, (int, float)):
        return value / divisor if divisor else value * 0.0
    value = tf.convert_to_tensor(value)
    return tf.math.divide_no_nan(value, tf.cast(divisor, value.dtype))

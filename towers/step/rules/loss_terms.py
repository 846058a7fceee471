"""The built-in step's loss terms probed (``probe.py``): every layer's
``add_loss`` terms and the model's own ``compute_loss``, each read as a mean,
a sum or neither over the batch's examples, and whether the forward pass
couples them; ``coupled.py`` decides what each means for the towers."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from towers._keras import call_model, compute_loss, layers_of, own_losses
from towers.step.rules.loss_kinds import may_add_terms, rows_match
from towers.step.rules.probe import Measured, probe


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


def probe_terms(
    model: keras.Model,
    batch: tuple[Any, Any, Any],
    own_loss: bool,
    device: str,
    training: bool = True,
    towers: int = 2,
    learned: Any = None,
) -> Probed:
    """The built-in step's loss terms that are not a mean over the examples
    of ``batch`` (x, y, sample_weight), by :func:`probe` on ``device``:
    every layer's ``add_loss`` terms and, with ``own_loss``, the model's
    ``compute_loss`` (called with ``training``: True as Keras' fit calls it,
    False as its evaluate does; ``learned``: the runner's, of its draws). An
    ``add_loss`` term that sums over the examples is a sum (each tower's adds
    up to one device's, unweighted); a ``compute_loss`` that sums couples
    them (it is weighted by the shares).

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
        found = probe(model, batch, ("call", terms), towers, learned)
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

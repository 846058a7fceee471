"""The non-public parts of Keras towers uses, in one place.

Two jobs have no public call.

Loss terms. A Keras loss reduces its values over the batch it is given: a mean
over a tower's shard. To make T shards add up to the whole batch exactly, towers
needs the loss *before* its reduction, weighted exactly as Keras weights it
(sample weights, masks, their ranks matched), and what the reduction would
divide by. Keras has no public call that stops there; ``Loss.__call__`` does it
with the helpers imported below, and so does ``towers/losses.py``, through this
module only.

Checked against Keras 3.15 (tests/test_losses.py compares every reduction, with
and without sample weights and masks, against Keras' own full-batch value).

Trainable changes. Freezing a layer sets its variables' ``trainable`` to False,
like a BatchNormalization's moving statistics, which are never trained; the
layers' own lists (``_trainable_variables``) still tell them apart. towers builds
the optimizer's slots for every variable a layer can train, so a layer unfrozen
between steps has its slots (tests/test_keras_parity.py).
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.backend import get_keras_mask
from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank

__all__ = [
    "apply_mask",
    "get_keras_mask",
    "layers_of",
    "squeeze_or_expand_to_same_rank",
    "trainable_capable",
]


def layers_of(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer of ``model``, nested ones included, itself first."""
    return list(model._flatten_layers(include_self=True))


def trainable_capable(model: keras.Model) -> list[Any]:
    """The variables a layer of ``model`` created trainable, frozen or not, in
    the order of ``model.weights``."""
    ids = {id(v) for layer in layers_of(model) for v in layer._trainable_variables}
    return [v for v in model.weights if id(v) in ids]

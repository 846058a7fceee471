"""The non-public parts of Keras towers uses, in one place.

A Keras loss reduces its values over the batch it is given: a mean over a tower's
shard. To make T shards add up to the whole batch exactly, towers needs the loss
*before* its reduction, weighted exactly as Keras weights it (sample weights,
masks, their ranks matched), and what the reduction would divide by. Keras has
no public call that stops there; ``Loss.__call__`` does it with the helpers
imported below, and so does ``towers/losses.py``, through this module only.

Checked against Keras 3.15 (tests/test_losses.py compares every reduction, with
and without sample weights and masks, against Keras' own full-batch value).
"""

from __future__ import annotations

from keras.src.backend import get_keras_mask
from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank

__all__ = ["apply_mask", "get_keras_mask", "squeeze_or_expand_to_same_rank"]

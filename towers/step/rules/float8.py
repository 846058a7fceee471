"""float8 training's scales and amax histories, as one device's.

A variable with ``overwrite_with_gradient`` (``Dense.quantize("float8")``'s
scales and histories) gets its new value as its "gradient", which Keras'
optimizer assigns. Each tower's is its shard's: the history with its
shard's largest magnitude first. One device's is the towers' elementwise
maximum, the rule Keras' own optimizer combines such values by over
accumulated steps; a value is never weighted by a tower's share.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf


def is_value(variable: Any) -> bool:
    """Whether ``variable``'s "gradient" is its new value, not a gradient."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def one_devices(variable: Any, grads: list[Any], reads: Any) -> Any:
    """The towers' values of ``variable`` as one device's: their maximum;
    None where ``variable`` takes a gradient (another rule's, or a sum)."""
    del reads  # a value reads the batch as its shard does: the maximum holds
    present = [g for g in grads if g is not None]
    if not is_value(variable) or not present:
        return None
    return functools.reduce(tf.maximum, present)

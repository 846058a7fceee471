"""Gradient accumulation's state: the window's weighted gradient sums.

``Towers(accumulate_steps=k)``: each step adds its combined gradient, weighted by
its examples, to sums on the variable device; every k-th step applies their
weighted mean (``towers/placement/update.py``). IndexedSlices are added as
slices (only the rows a step touched). The sums are saved with checkpoints, so
a run stopped inside a window resumes inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class Accumulator(tf.Module):
    """Gradient sums on the variable device, saved with checkpoints.

    Attributes:
      sums: per trainable variable, the weighted sum of this window's gradients.
      weight: the sum of the weights (examples, for a mean loss).
      count: steps in the current window.
    """

    def __init__(self, variables: Sequence[Any], device: str):
        super().__init__(name="gradient_accumulator")
        self._index = {id(v): i for i, v in enumerate(variables)}
        with tf.device(device):
            self.sums = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                for v in variables
            ]
            self.weight = tf.Variable(0.0, trainable=False)
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def add(self, pairs: list, weight: Any) -> None:
        for grad, var in pairs:
            total = self.sums[self._index[id(var)]]
            if isinstance(grad, tf.IndexedSlices):
                # Slices stay slices: only the rows this step touched are added.
                values = grad.values * tf.cast(weight, total.dtype)
                total.scatter_add(tf.IndexedSlices(values, grad.indices))
            else:
                total.assign_add(grad * tf.cast(weight, total.dtype))
        self.weight.assign_add(weight)
        self.count.assign_add(1)

    def read(self, var: Any) -> tf.Tensor:
        return self.sums[self._index[id(var)]].read_value()

    def reset(self) -> None:
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        self.weight.assign(0.0)
        self.count.assign(0)

"""One copy of the model and optimizer per tower: the replicated and independent
placements.

- ``"replicated"``: the towers' gradients are all-reduced on TensorFlow's
  collective runtime (``towers/collective.py``) and every tower applies the same
  sum to its own copy, so the copies stay identical. Every tower joins every
  all-reduce, even one with no examples this step (it contributes zeros).
- ``"independent"``: each tower applies its own gradient to its own copy and
  nothing is exchanged: the zero-communication baseline for measurements.

Copy 0 is the engine's ``model`` and ``optimizer`` (what checkpoints save and
evaluation reads); ``sync`` copies it to the others, at the start and after a
restore. Sparse gradients are all-reduced dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.collective import AllReduce


class Replicas:
    """The towers' model and optimizer copies, one per device.

    Args:
      build: a zero-arg function that makes the model (called once per device).
      optimizer: a Keras optimizer (tower 0 uses it, the others a copy made from
        its config) or a zero-arg function that makes one per tower.
      devices: the towers' devices; copy t lives on ``devices[t]``.
      placement: ``"replicated"`` or ``"independent"``.
      reducer: the all-reduce's reducer, ``"per_tensor"`` or ``"packed"``.
    """

    def __init__(
        self,
        build: Callable[[], keras.Model],
        optimizer: Any,
        devices: Sequence[str],
        placement: str,
        reducer: Any,
    ):
        self.devices = list(devices)
        self.placement = placement
        self.models = []
        self.optimizers = []
        for t, device in enumerate(self.devices):
            with tf.device(device):
                self.models.append(build())
                self.optimizers.append(_optimizer_for(optimizer, copy=t > 0))
        self.all_reduce = (
            AllReduce(self.devices, reducer) if placement == "replicated" else None
        )

    def build(self, sample: Any = None) -> None:
        """Creates every copy's variables (from ``sample`` if built lazily), then
        makes them equal to copy 0's."""
        for model, optimizer, device in zip(self.models, self.optimizers, self.devices):
            with tf.device(device):
                if sample is not None and not model.variables:
                    model(sample, training=False)
                if not optimizer.built:
                    optimizer.build(model.trainable_variables)
        self.sync()

    def sync(self) -> None:
        """Copies copy 0's variables and optimizer state to every other copy."""
        first = self.models[0].variables + self.optimizers[0].variables
        for model, optimizer in zip(self.models[1:], self.optimizers[1:]):
            for source, target in zip(first, model.variables + optimizer.variables):
                target.assign(source)

    def reduce(self, tower_grads: list[list[Any]]) -> list[list[Any]]:
        """Replicated: each tower's gradients replaced by their sum over towers
        (every tower's, in order). Independent: the gradients as they are."""
        if self.all_reduce is None:
            return tower_grads
        variables = [m.trainable_variables for m in self.models]
        return self._summed(tower_grads, variables)

    def apply(self, tower_grads: list[list[Any]]) -> None:
        """Applies ``tower_grads[t]`` to copy t, on tower t's device."""
        for t, device in enumerate(self.devices):
            with tf.device(device), tf.name_scope(f"apply_{t}"):
                variables = self.models[t].trainable_variables
                pairs = [
                    (g, v) for g, v in zip(tower_grads[t], variables) if g is not None
                ]
                self.optimizers[t].apply_gradients(pairs)

    def _summed(self, tower_grads: list[list[Any]], variables) -> list[list[Any]]:
        """Every tower's gradients replaced by their sum over towers."""
        used = [
            v
            for v in range(len(variables[0]))
            if any(grads[v] is not None for grads in tower_grads)
        ]
        dense = []
        for t, device in enumerate(self.devices):
            with tf.device(device):
                dense.append([_dense(tower_grads[t][v], variables[t][v]) for v in used])
        with tf.name_scope("all_reduce"):
            sums = self.all_reduce.all_reduce(dense)
        out = [[None] * len(variables[0]) for _ in self.devices]
        for t in range(len(self.devices)):
            for v, total in zip(used, sums[t]):
                out[t][v] = total
        return out


def _dense(grad: Any, var: Any) -> tf.Tensor:
    if grad is None:  # this tower's examples do not reach the variable
        return tf.zeros(var.shape, var.dtype)
    return tf.convert_to_tensor(grad)


def _optimizer_for(optimizer: Any, copy: bool) -> keras.optimizers.Optimizer:
    """Tower 0 gets the optimizer as given; the others a copy from its config."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return (
            type(optimizer).from_config(optimizer.get_config()) if copy else optimizer
        )
    made = optimizer() if callable(optimizer) else optimizer
    if not isinstance(made, keras.optimizers.Optimizer):
        raise ValueError(
            "optimizer must be a keras.optimizers.Optimizer or a zero-arg function "
            f"that makes one; received {optimizer!r}"
        )
    return made

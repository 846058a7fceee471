"""Balanced placement's two tools: spreading variables over devices by bytes, and
running each variable's update where it lives.

``balance`` is the greedy plan (largest first, each to the emptiest device).
``build_balanced`` builds the model twice: once to learn its variables' sizes in
creation order, once with each variable created on its planned device.
``updates_where_variables_live`` keeps the optimizer's per-variable update on the
variable's device, where Keras would place it by the surrounding scope.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers._keras import build_symbolically
from towers.placement.base import variable_bytes


def balance(sizes: Sequence[int], devices: Sequence[str]) -> list[str]:
    """Assigns each size to a device, greedily, largest first.

    Each item goes to the device with the fewest bytes so far (the earliest such
    device on a tie); items of equal size keep their order.

    Args:
      sizes: bytes of each variable.
      devices: the devices to spread them over.

    Returns:
      One device per size, in the order of ``sizes``.

    Example:
      >>> balance([10, 400, 30, 300], ["A", "B"])
      ['B', 'A', 'B', 'B']
    """
    if not devices:
        raise ValueError("balance needs at least one device; received []")
    loads = {device: 0 for device in devices}
    chosen: list[str] = [""] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        device = min(devices, key=lambda d: loads[d])
        chosen[index] = device
        loads[device] += sizes[index]
    return chosen


def build_balanced(
    build: Callable[[], keras.Model],
    devices: Sequence[str],
    sample: Any = None,
    model: Any = None,
) -> keras.Model:
    """Builds a model with its variables balanced over ``devices`` by bytes.

    The model is built twice: once to learn its variables' sizes in creation
    order (that build is thrown away), once with each variable created on its
    planned device. With ``sample`` (a batch, for a model built lazily), the
    variables its shapes make are placed so in ``model`` itself, its compile
    kept.

    Args:
      build: a zero-arg function that makes the model.
      devices: the devices to spread the variables over.
      sample: a batch whose shapes build ``model``.
      model: the lazily built model ``build`` made (with ``sample``).
    """
    if sample is None:
        with _recording_sizes() as sizes:
            build()
        with _creating_on(balance(sizes, devices)):
            return build()
    thrown = build()
    with _recording_sizes() as sizes:
        build_symbolically(thrown, sample)
    with _creating_on(balance(sizes, devices)):
        build_symbolically(model, sample)
    return model


@contextlib.contextmanager
def _recording_sizes() -> Iterator[list[int]]:
    sizes: list[int] = []

    def creator(next_creator, **kwargs):
        var = next_creator(**kwargs)
        sizes.append(variable_bytes(var))
        return var

    with tf.variable_creator_scope(creator):
        yield sizes


@contextlib.contextmanager
def _creating_on(plan: list[str]) -> Iterator[None]:
    remaining = iter(plan)

    def creator(next_creator, **kwargs):
        device = next(remaining, None)
        if device is None:
            raise RuntimeError(
                "the model made more variables on its second build than its first "
                f"({len(plan)}); balanced placement needs a builder that makes the "
                "same variables every time"
            )
        with tf.device(device):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


@contextlib.contextmanager
def updates_where_variables_live(
    optimizer: keras.optimizers.Optimizer,
) -> Iterator[None]:
    """Runs each variable's optimizer update on that variable's device.

    Keras places an update's arithmetic by the surrounding device scope; with
    variables on several devices that would pull every update onto one. While
    the step is traced, the optimizer's ``update_step`` (public, per variable)
    runs under the variable's device.

    Args:
      optimizer: the engine's optimizer (a LossScaleOptimizer's inner one is used).
    """
    target = getattr(optimizer, "inner_optimizer", optimizer)
    original = target.update_step

    def update_step(gradient, variable, learning_rate):
        # Keras hands over the tf.Variable; its device is where it was created.
        with tf.device(variable.device):
            return original(gradient, variable, learning_rate)

    target.update_step = update_step
    try:
        yield
    finally:
        del target.update_step

"""Variable placements: where the variables live and how gradients reach them.

``Towers(placement=...)`` takes one of four modes, each a :class:`Placement`
subclass, as tf_cnn_benchmarks' ``VariableMgr`` family:

- ``"central"`` (:class:`towers.placement.shared.Central`, default): every
  variable on ``variable_device`` (the CPU unless told otherwise; pass a
  tower's device for "on one device"). The towers' gradients are combined there
  and applied there: a parameter device.
- ``"balanced"`` (:class:`towers.placement.shared.Balanced`): variables spread
  over the tower devices by bytes, largest first
  (``towers/placement/balance.py``). Each variable's gradients are combined, and
  its update runs, on its own device.
- ``"replicated"`` (:class:`towers.placement.replicas.Replicated`): a copy of every
  variable on every tower's device, kept identical: the towers' gradients are
  all-reduced with TensorFlow's collective ops and each tower applies the same
  sum to its copy, as MirroredStrategy does.
- ``"independent"`` (:class:`towers.placement.replicas.Independent`): a copy
  per tower and no synchronisation at all: each tower applies its own gradient
  to its own copy. Not training (the copies drift apart): the
  zero-communication baseline a measurement needs.

What each moves per step, for gradients of S bytes and n towers, is in
``docs/sync-cost.md``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import keras
import tensorflow as tf

from towers.devices import same_device
from towers.placement.update import Update
from towers.split import Shards


class Placement(abc.ABC):
    """Where a model's variables live, and how the towers' gradients reach them.

    A placement owns the step's variable side::

        build(model, optimizer)      the model(s) and optimizer(s), placed
        model_of(t)                  the model tower t runs
        combine(tower_grads)         tower_grads[t][v] -> what apply takes
        apply(update, grads, ...)    once per step
        refuse(...), check_devices() what it cannot do; where it put things

    Args:
      devices: the towers' devices, in tower order.
      variable_device: where shared variables live (the central placement's
        parameter device; the others' home for the steps counter and metrics).
      reducer: how dense gradients are summed (``towers/reducers.py``).
    """

    name: ClassVar[str]
    # Whether the workers of a cluster can train with it (towers/cluster/workers.py).
    joins_clusters: ClassVar[bool] = False
    # Whether sparse gradients travel as dense tensors (an all-reduce's must).
    sends_slices_dense: ClassVar[bool] = False

    def __init__(self, devices: Sequence[str], variable_device: str, reducer: Any):
        self.devices = list(devices)
        self.variable_device = variable_device
        self.reducer = reducer
        self.models: list[keras.Model] = []
        self.optimizers: list[keras.optimizers.Optimizer] = []

    @property
    def model(self) -> keras.Model:
        """The engine's model: the shared one, or tower 0's copy (what
        checkpoints save and evaluation reports)."""
        return self.models[0]

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The engine's optimizer: the shared one, or tower 0's."""
        return self.optimizers[0]

    @abc.abstractmethod
    def build(self, model: Any, optimizer: Any) -> None:
        """Makes the model(s) and optimizer(s) from the engine's arguments."""

    @abc.abstractmethod
    def build_from(self, sample: Any) -> None:
        """Creates a lazily built model's variables from one example."""

    @abc.abstractmethod
    def build_slots(self) -> None:
        """Creates the optimizers' slot variables, where the placement says."""

    @abc.abstractmethod
    def follow_trainable(self) -> None:
        """Makes every model a tower runs train what :attr:`model` trains (a
        copy per tower follows copy 0)."""

    def model_of(self, t: int) -> keras.Model:
        """The model tower ``t`` runs (the shared one unless there are copies)."""
        return self.models[0]

    def working_towers(self, shards: Shards) -> list[int]:
        """The towers that run this step: those with examples."""
        return shards.working()

    @abc.abstractmethod
    def combine(self, tower_grads: list[list[Any]]) -> list[Any]:
        """``tower_grads[t][v]`` -> the gradients :meth:`apply` takes."""

    @abc.abstractmethod
    def apply(
        self,
        update: Update,
        grads: list[Any],
        tower_variables: list[list[Any]],
        also: Callable[[], None],
        weight: Any,
    ) -> tf.Tensor | None:
        """Applies one step's combined gradients, and ``also`` (the moving
        statistics) with them, inside the step's ``apply`` name scope; returns
        the finiteness flags, or None.

        ``tower_variables[t]``: the variables tower t's gradients are for, read
        when the step was traced; ``weight``: the step's weight in an
        accumulation window (``Update.apply``).
        """

    @abc.abstractmethod
    def refuse(self, update: Update, batch_norm: bool) -> None:
        """Raises ValueError for an option this placement cannot serve yet."""

    @abc.abstractmethod
    def check_devices(self) -> None:
        """Raises ValueError if a model or optimizer variable is elsewhere than
        the placement says."""

    @abc.abstractmethod
    def after_restore(self) -> None:
        """Brings the rest of the state to a restored checkpoint of :attr:`model`
        and :attr:`optimizer`."""

    def finalize(self) -> None:
        """As Keras' fit ends: each optimizer with ``use_ema=True`` writes its
        moving average of the weights into its model's weights."""
        for model, optimizer in zip(self.models, self.optimizers):
            if optimizer is not None:
                optimizer.finalize_variable_values(model.trainable_weights)

    @abc.abstractmethod
    def topology(self) -> str:
        """How the gradients travel, in words (for ``towers bench``)."""


def check_on(var: Any, owner: str, expected: str, where: str) -> None:
    """Raises ValueError unless ``var`` lives on ``expected``.

    Args:
      var: a model or optimizer variable.
      owner: ``"model"`` or ``"optimizer slot"``, for the message.
      expected: the device it should be on.
      where: that device in words, e.g. ``"the variable device /device:CPU:0"``.
    """
    device = var.handle.device
    if not same_device(device, expected):
        name = getattr(var, "path", var.name)
        raise ValueError(
            f"{owner} variables must live on {where}; received {name!r} on "
            f"{device}. "
            "Pass a zero-arg function that builds the model (towers builds it "
            f"there), or build it inside `with tf.device({expected!r})`."
        )


def slot_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The optimizer's variables except the scalars Keras made with it (its
    iteration count and learning rate, which live where it was made); none for
    an engine that only predicts (None)."""
    if optimizer is None:
        return []
    optimizers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    own = {
        id(v)
        for opt in optimizers
        if opt is not None
        for v in (opt.iterations, opt._learning_rate)
    }
    return [v for v in optimizer.variables if id(v) not in own]


def needs_builder(placement: str, model: Any) -> Callable[[], keras.Model]:
    """``model`` if it is a zero-arg builder; placements that make the model
    themselves (on several devices, or several times) refuse a built one."""
    if isinstance(model, keras.Model) or not callable(model):
        raise ValueError(
            f"placement={placement!r} builds the model itself: model must "
            f"be a zero-arg function that builds one; received {model!r}"
        )
    return model


def variable_bytes(var: Any) -> int:
    """Bytes a variable holds.

    >>> variable_bytes(tf.Variable(tf.zeros([3, 4])))
    48
    """
    return int(var.shape.num_elements()) * tf.as_dtype(var.dtype).size


def bytes_by_device(variables: Sequence[Any]) -> dict[str, int]:
    """Total variable bytes on each device, in first-seen order."""
    totals: dict[str, int] = {}
    for var in variables:
        device = var.handle.device
        totals[device] = totals.get(device, 0) + variable_bytes(var)
    return totals

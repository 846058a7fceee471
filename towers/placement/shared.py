"""Shared variables: one copy of the model that every tower reads.

The towers' gradients of each variable are combined once, on a device that holds
variables, and applied once::

    tower_grads[t][v]  ->  combine_gradients(sum), per device group  ->  grads[v]
                       ->  update.apply(grads)   (one optimizer iteration)

- :class:`Central`: every variable on ``variable_device``; one group.
- :class:`Balanced`: variables spread over the tower devices by bytes; a group
  per device, each combined and updated where its variables live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from towers._keras import build_symbolically
from towers._keras.optimizers import build_optimizer
from towers.combine import combine_gradients
from towers.devices import same_device
from towers.placement.balance import build_balanced, updates_where_variables_live
from towers.placement.base import Placement, check_on, needs_builder, slot_variables
from towers.placement.update import Update, make_optimizer, needs_loss_scaling
from towers.reducers import Sharded


class SharedVariables(Placement):
    """One set of variables, combined and applied once per step."""

    def build_slots(self) -> None:
        if self.optimizer is not None:
            with tf.device(self.variable_device):
                # The variables trainable now, as Keras' fit builds it (and
                # those unfrozen since, at a later call).
                build_optimizer(self.optimizer, self.model.trainable_variables)

    def refuse(self, update: Update, batch_norm: bool) -> None:
        # One set of variables and one apply: every update policy and
        # BatchNormalization's moving statistics work as on one device.
        return None

    def after_restore(self) -> None:
        # The checkpoint restored the only copy.
        return None

    def follow_trainable(self) -> None:
        # Every tower runs the one model.
        return None

    def combine(self, tower_grads: list[list[Any]], variables: Any = None) -> list[Any]:
        """One sum per variable, each on its variable's device (``variables``:
        those the gradients are for, the model's trainable ones unless given:
        a model's own step's apply)."""
        combined: list[Any] = [None] * len(tower_grads[0])
        variables = self.trainable if variables is None else variables
        for device, indices in self.groups(variables):
            with tf.device(device), tf.name_scope("combine"):
                part = combine_gradients(
                    [[grads[v] for v in indices] for grads in tower_grads],
                    reduction="sum",
                    reducer=self.reducer,
                )
            for v, grad in zip(indices, part):
                combined[v] = grad
        return combined

    def apply(
        self,
        update: Update,
        grads: list[Any],
        tower_variables: list[list[Any]],
        also: Callable[[], None],
        weight: Any,
    ) -> tf.Tensor | None:
        with tf.device(self.variable_device):
            with self.placing_updates(update.optimizer):
                return update.apply(grads, tower_variables[0], also, weight)

    def groups(self, variables: list) -> list[tuple[str, list[int]]]:
        """(device, indices of ``variables`` combined there)."""
        return [(self.variable_device, list(range(len(variables))))]

    def placing_updates(self, optimizer: keras.optimizers.Optimizer):
        """Where the optimizer's per-variable updates run: by the apply's scope."""
        return contextlib.nullcontext()

    def check_devices(self) -> None:
        devices = {
            v.path.replace("/", "_"): v.handle.device for v in self.model.variables
        }
        for var in self.model.variables:
            self._check(var, "model", self.home(var))
        for slot in slot_variables(self.optimizer):
            # Keras names a slot after its variable's path and colocates it.
            owner = max(
                (k for k in devices if slot.name.startswith(k + "_")),
                key=len,
                default=None,
            )
            home = (
                self.variable_device
                if owner is None
                else self.slot_home(devices[owner])
            )
            self._check(slot, "optimizer slot", home)

    def home(self, var: Any) -> str:
        """Where a model variable should live."""
        return self.variable_device

    def slot_home(self, owner_device: str) -> str:
        """Where the slot of a variable on ``owner_device`` should live."""
        return self.variable_device

    def _check(self, var: Any, owner: str, home: str) -> None:
        check_on(var, owner, home, f"the variable device {home}")

    def topology(self) -> str:
        where = self.combined_on()
        if isinstance(self.reducer, Sharded):
            return f"reduce-scatter over the towers, then gather to {where}"
        return f"reduce to {where} (a star, not a ring)"

    def combined_on(self) -> str:
        """Where the gradients are combined, in words."""
        return self.variable_device

    @property
    def trainable(self) -> list:
        return self.model.trainable_variables

    def _optimizer(self, optimizer: Any) -> keras.optimizers.Optimizer:
        return make_optimizer(
            optimizer, self.variable_device, needs_loss_scaling(self.model)
        )


class Central(SharedVariables):
    """Every variable on ``variable_device``: a parameter device."""

    name = "central"
    joins_clusters = True

    def build(self, model: Any, optimizer: Any) -> None:
        if not isinstance(model, keras.Model) and callable(model):
            with tf.device(self.variable_device):
                model = model()
        if not isinstance(model, keras.Model):
            raise ValueError(
                "model must be a Keras model or a zero-arg function that builds "
                f"one; received {model!r}"
            )
        self.models = [model]
        self.optimizers = [self._optimizer(optimizer)]

    def build_from(self, sample: Any) -> None:
        with tf.device(self.variable_device):
            build_symbolically(self.model, sample)


class Balanced(SharedVariables):
    """Variables spread over the tower devices by bytes, largest first; each
    combined and updated on its own device."""

    name = "balanced"

    def build(self, model: Any, optimizer: Any) -> None:
        self.builder = needs_builder(self.name, model)
        with tf.device(self.variable_device):
            self.models = [build_balanced(self.builder, self.devices)]
        self.optimizers = [self._optimizer(optimizer)]

    def build_from(self, sample: Any) -> None:
        # The plan needs the sizes of the variables the shapes make.
        with tf.device(self.variable_device):
            build_balanced(self.builder, self.devices, sample, self.model)

    def groups(self, variables: list) -> list[tuple[str, list[int]]]:
        groups: dict[str, list[int]] = {}
        for v, var in enumerate(variables):
            groups.setdefault(var.handle.device, []).append(v)
        return list(groups.items())

    def placing_updates(self, optimizer: keras.optimizers.Optimizer):
        return updates_where_variables_live(optimizer)

    def combined_on(self) -> str:
        return "each variable's device"

    def home(self, var: Any) -> str:
        # A variable the plan put on a tower device stays there; anything else
        # belongs on the first tower's.
        own = var.handle.device
        return (
            own if any(same_device(own, d) for d in self.devices) else self.devices[0]
        )

    def slot_home(self, owner_device: str) -> str:
        return owner_device

    def _check(self, var: Any, owner: str, home: str) -> None:
        check_on(var, owner, home, f"{home} (placement={self.name!r})")

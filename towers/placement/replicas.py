"""A copy of the model and optimizer per tower: the replicated and independent
placements.

- :class:`Replicated`: the towers' gradients are all-reduced on TensorFlow's
  collective runtime (``towers/placement/collective.py``) and every tower
  applies the same sum to its own copy, so the copies stay identical. Every
  tower joins every all-reduce, even one with no examples this step (it
  contributes zeros).
  Sparse gradients are all-reduced dense.
- :class:`Independent`: each tower applies its own gradient to its own copy and
  nothing is exchanged: the zero-communication baseline for measurements.

Copy 0 is the engine's ``model`` and ``optimizer`` (what checkpoints save and
evaluation reads); ``sync`` copies it to the others, at the start and after a
restore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from towers._keras import build_symbolically, layers_of
from towers._keras.optimizers import build_optimizer
from towers.options import refuse_unsupported
from towers.placement.base import Placement, check_on, needs_builder, slot_variables
from towers.placement.collective import AllReduce
from towers.placement.update import Update, make_optimizer, needs_loss_scaling
from towers.split import Shards


class Copies(Placement):
    """Each tower has its own copy of the variables, on its own device."""

    def build(self, model: Any, optimizer: Any) -> None:
        build = needs_builder(self.name, model)
        for t, device in enumerate(self.devices):
            with tf.device(device):
                self.models.append(build())
            self.optimizers.append(_optimizer_for(optimizer, t, device))

    def build_from(self, sample: Any) -> None:
        for model, device in zip(self.models, self.devices):
            with tf.device(device):
                build_symbolically(model, sample)

    def build_slots(self) -> None:
        """Creates every copy's slots, then (the first time) makes every copy
        equal to copy 0; later, slots for the variables unfrozen since."""
        first = not any(o is not None and o.built for o in self.optimizers)
        for model, optimizer, device in zip(self.models, self.optimizers, self.devices):
            if optimizer is not None:
                with tf.device(device):
                    build_optimizer(optimizer, model.trainable_variables)
        if first:
            self.sync()

    def sync(self) -> None:
        """Copies copy 0's variables and optimizer state to every other copy
        (the optimizers a model holds as its own attributes too, once built:
        a model's own train_step applies with them)."""
        first = _state(self.models[0], self.optimizers[0])
        for model, optimizer in zip(self.models[1:], self.optimizers[1:]):
            for source, target in zip(first, _state(model, optimizer), strict=True):
                target.assign(source)

    def after_restore(self) -> None:
        """Brings every copy to the restored copy 0.

        Raises:
          ValueError: copy 0 holds an optimizer of its own not built yet:
            its restored state would reach it alone, at its first apply.
        """
        unbuilt = [o.name for o in own_optimizers(self.models[0]) if not o.built]
        if unbuilt:
            raise ValueError(
                f"placement={self.name!r} cannot resume a model whose own "
                f"optimizers ({', '.join(unbuilt)}) are built at their first "
                "apply: their restored state would reach copy 0 alone. Resume "
                "with placement='central' or 'balanced'."
            )
        self.sync()  # the checkpoint holds copy 0

    def follow_trainable(self) -> None:
        """Every copy's layers take copy 0's ``trainable`` (the user changes
        ``engine.model``, which is copy 0)."""
        first = layers_of(self.models[0])
        for model in self.models[1:]:
            for source, target in zip(first, layers_of(model)):
                target.trainable = source.trainable

    def model_of(self, t: int) -> keras.Model:
        return self.models[t]

    def working_towers(self, shards: Shards) -> list[int]:
        # Every copy takes part in every step (with zeros when it has no examples).
        return list(range(len(self.devices)))

    def apply(
        self,
        update: Update,
        grads: list[list[Any]],
        tower_variables: list[list[Any]],
        also: Callable[[], None],
        weight: Any,
    ) -> None:
        """Applies ``grads[t]`` to copy t's variables, on tower t's device."""
        for t, device in enumerate(self.devices):
            with tf.device(device), tf.name_scope(f"apply_{t}"):
                pairs = [
                    (g, v)
                    for g, v in zip(grads[t], tower_variables[t])
                    if g is not None
                ]
                if pairs:  # none: a model without trainable variables
                    self.optimizers[t].apply_gradients(pairs)
        also()
        return None

    def refuse(self, update: Update, batch_norm: bool) -> None:
        refuse_unsupported(
            f"placement={self.name!r}",
            {
                "accumulate_steps > 1": update.accumulate_steps > 1,
                f"on_nonfinite={update.on_nonfinite!r}": update.on_nonfinite
                != "ignore",
                "BatchNormalization layers": batch_norm,
                "mixed_float16 (loss scaling)": needs_loss_scaling(self.model),
            },
            "Use placement='central' or 'balanced'.",
        )

    def check_devices(self) -> None:
        for t, device in enumerate(self.devices):
            where = f"{device} (placement={self.name!r})"
            for var in self.models[t].variables:
                check_on(var, "model", device, where)
            for slot in slot_variables(self.optimizers[t]):
                check_on(slot, "optimizer slot", device, where)


class Replicated(Copies):
    """Copies kept identical: every tower applies the all-reduced sum."""

    name = "replicated"
    sends_slices_dense = True

    def build(self, model: Any, optimizer: Any) -> None:
        super().build(model, optimizer)
        # Refuses reducers an all-reduce cannot take, before anything runs.
        self.all_reduce = AllReduce(self.devices, self.reducer)

    def combine(
        self,
        tower_grads: list[list[Any]],
        variables: list[list[Any]] | None = None,
        first_instance: int = 0,
    ) -> list[list[Any]]:
        """Each tower's gradients replaced by their sum over every tower:
        ``tower_grads[t][v]`` for ``variables[t][v]`` (default: each copy's
        trainable variables), the collectives' keys from ``first_instance``
        (each apply of a model's own step takes its own,
        ``towers/step/work/copies.py``). None where no tower has one."""
        if variables is None:
            variables = [m.trainable_variables for m in self.models]
        used = [
            v
            for v in range(len(variables[0]))
            if any(grads[v] is not None for grads in tower_grads)
        ]
        dense = []
        for t, device in enumerate(self.devices):
            with tf.device(device):
                dense.append(
                    [as_dense(tower_grads[t][v], variables[t][v]) for v in used]
                )
        with tf.name_scope("all_reduce"):
            sums = self.all_reduce.all_reduce(dense, first_instance)
        out = [[None] * len(variables[0]) for _ in self.devices]
        for t in range(len(self.devices)):
            for v, total in zip(used, sums[t]):
                out[t][v] = total
        return out

    def topology(self) -> str:
        return "ring all-reduce over the towers (CollectiveReduceV2)"


class Independent(Copies):
    """Copies that never synchronise: a measurement baseline, not training.

    BatchNormalization is allowed: each copy normalises its shard and moves its
    own statistics (the zero-sync floor of a BatchNormalization model).
    """

    name = "independent"

    def refuse(self, update: Update, batch_norm: bool) -> None:
        super().refuse(update, batch_norm=False)

    def combine(self, tower_grads: list[list[Any]]) -> list[list[Any]]:
        return tower_grads  # each tower keeps its own

    def topology(self) -> str:
        return "none: towers never exchange gradients"


def as_dense(grad: Any, var: Any) -> tf.Tensor:
    if grad is None:  # this tower's examples do not reach the variable
        return tf.zeros(var.shape, var.dtype)
    return tf.convert_to_tensor(grad)


def _optimizer_for(optimizer: Any, t: int, device: str) -> keras.optimizers.Optimizer:
    """Tower 0 gets the optimizer as given; the others a copy from its config
    (or their own, from a zero-arg function)."""
    if t > 0 and isinstance(optimizer, keras.optimizers.Optimizer):
        with tf.device(device):
            return type(optimizer).from_config(optimizer.get_config())
    return make_optimizer(optimizer, device)


def own_optimizers(model: keras.Model) -> list[keras.optimizers.Optimizer]:
    """The optimizers ``model`` holds as attributes besides its compiled one
    (a GAN's ``d_optimizer`` and ``g_optimizer``), in attribute order."""
    compiled = getattr(model, "optimizer", None)
    return [
        value
        for value in vars(model).values()
        if isinstance(value, keras.optimizers.Optimizer) and value is not compiled
    ]


def _state(model: keras.Model, optimizer: Any) -> list:
    """A copy's variables, its engine optimizer's and its own built ones'."""
    own = [v for o in own_optimizers(model) if o.built for v in o.variables]
    return model.variables + _variables(optimizer) + own


def _variables(optimizer: keras.optimizers.Optimizer | None) -> list:
    """An optimizer's variables; none for an engine that only predicts."""
    return [] if optimizer is None else optimizer.variables

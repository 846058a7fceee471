"""Towers: one model, shared variables on one device, one tower per compute device.

One training step is one ``tf.function``::

    (x, y): B examples on the host
      -> split_batch                      shards of n_t examples, sum_t n_t = B
      -> tower t on devices[t]            loss_t = sum(per-example loss) / B
                                          tower_grads[t] = d loss_t / d vars
      -> combine_gradients(sum)           on the variable device
      -> optimizer.apply_gradients once   on the variable device

Because each tower's loss is already divided by the *global* B, the sum of tower
gradients is the full-batch gradient: T towers give one device's update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.combine import combine_gradients
from towers.devices import canonical_device, resolve_devices, same_device
from towers.losses import TowerLoss
from towers.split import batch_size_of, split_batch, split_sizes

# Input arrives on the host and is split there, whatever the compute devices are.
_HOST = "/device:CPU:0"


class Towers:
    """Data-parallel training with one tower per device and shared variables.

    Args:
      model: a zero-arg function that builds a Keras model (it is called under
        ``variable_device``), or a Keras model whose variables already live there.
      loss: a ``keras.losses.Loss`` (any reduction), a Keras loss name, or a
        function ``(y_true, y_pred) -> per-example losses``.
      optimizer: a Keras optimizer, or a zero-arg function that makes one (called
        under ``variable_device``). Its slots are always created on
        ``variable_device``; its iteration count and learning rate, which Keras
        creates with the optimizer, live where it was made.
      devices: one device per tower; default every GPU, else the CPU.
      variable_device: where variables live, gradients are combined and applied.

    Raises:
      ValueError: unknown or repeated devices, a model that is not a Keras model,
        or variables (model or optimizer) that live off ``variable_device``.

    Example:
      >>> import keras, numpy as np, towers
      >>> eng = towers.Towers(
      ...     lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
      ...     loss="mse", optimizer=keras.optimizers.SGD(0.1),
      ...     devices=["/cpu:0", "/cpu:1"])
      >>> x, y = np.ones((5, 3), "float32"), np.zeros((5, 1), "float32")
      >>> logs = eng.train_step(x, y)
      >>> sorted(logs), int(eng.optimizer.iterations.numpy())
      (['loss'], 1)
    """

    def __init__(
        self,
        model: keras.Model | Callable[[], keras.Model],
        loss: Any,
        optimizer: keras.optimizers.Optimizer,
        devices: Sequence[str] | None = None,
        variable_device: str = "/cpu:0",
    ):
        self.devices = resolve_devices(devices)
        self.variable_device = canonical_device(variable_device)
        self.loss = TowerLoss(loss)
        self.model = self._build_model(model)
        self.optimizer = self._build_optimizer(optimizer)
        self._step_fn = tf.function(self._step)
        if self.model.built and self.model.variables:
            self._finish_build()

    @property
    def num_towers(self) -> int:
        return len(self.devices)

    @property
    def trace_count(self) -> int:
        """How many times the step has been traced (one per input signature)."""
        return self._step_fn.experimental_get_tracing_count()

    def train_step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        """Runs one training step on a global batch.

        Args:
          x: inputs, a tensor/array or nest of them, B examples on the first axis.
          y: targets, the same B.

        Returns:
          ``{"loss": scalar}``, the full-batch loss before this step's update.

        Raises:
          ValueError: x and y disagree on B, B == 0, or the loss does not return one
            value per example. Nothing is updated when a step fails.
        """
        x_size, y_size = batch_size_of(x), batch_size_of(y)
        if x_size != y_size:
            raise ValueError(
                "x and y must have the same batch size; received x with "
                f"{x_size} examples and y with {y_size}"
            )
        if x_size == 0:
            raise ValueError("a batch needs at least one example; received 0")
        with tf.device(_HOST):
            x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        if not self.model.variables:
            self._build_from_batch(x)
        return self._step_fn(x, y)

    # -- the step -----------------------------------------------------------------

    def _step(self, x: Any, y: Any) -> dict[str, tf.Tensor]:
        with tf.device(_HOST), tf.name_scope("split"):
            global_batch = batch_size_of(x)
            shards = split_batch((x, y), self.num_towers)
        sizes = (
            split_sizes(global_batch, self.num_towers)
            if isinstance(global_batch, int)
            else [None] * self.num_towers
        )
        tower_losses, tower_grads = [], []
        for t, device in enumerate(self.devices):
            if sizes[t] == 0:
                continue  # B < T: this tower has no examples and does no work.
            with tf.device(device), tf.name_scope(f"tower_{t}"):
                loss_t, grads_t = self._tower(*shards[t], global_batch)
            tower_losses.append(loss_t)
            tower_grads.append(grads_t)
        with tf.device(self.variable_device), tf.name_scope("combine"):
            grads = combine_gradients(tower_grads, reduction="sum")
            loss = tf.add_n(tower_losses)
        with tf.device(self.variable_device), tf.name_scope("apply"):
            # Every tower (and every check in it) has finished before any update.
            with tf.control_dependencies([loss]):
                self._apply(grads)
        return {"loss": loss}

    def _tower(self, x_t: Any, y_t: Any, global_batch: Any):
        """One tower: forward, this tower's share of the loss, and its gradients."""
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self.model(x_t, training=True)
            loss_t = self.loss.tower_loss(y_t, y_pred, global_batch)
            if self.model.losses:
                # Regularisers are per-batch means in Keras 3: weight by n_t / B so
                # the towers' shares add up to the full batch's one.
                share = tf.cast(batch_size_of(x_t), tf.float32) / tf.cast(
                    global_batch, tf.float32
                )
                loss_t += tf.add_n(self.model.losses) * share
        return loss_t, tape.gradient(loss_t, variables)

    def _apply(self, grads: list) -> None:
        pairs = [
            (g, v)
            for g, v in zip(grads, self.model.trainable_variables)
            if g is not None
        ]
        if not pairs:
            raise ValueError(
                "no trainable variable gets a gradient from the loss; received a loss "
                f"({self.loss.name}) that does not depend on the model's variables"
            )
        self.optimizer.apply_gradients(pairs)

    # -- building and placement ---------------------------------------------------

    def _build_model(self, model: Any) -> keras.Model:
        if not isinstance(model, keras.Model) and callable(model):
            with tf.device(self.variable_device):
                model = model()
        if not isinstance(model, keras.Model):
            raise ValueError(
                "model must be a Keras model or a zero-arg function that builds one; "
                f"received {model!r}"
            )
        return model

    def _build_optimizer(self, optimizer: Any) -> keras.optimizers.Optimizer:
        if not isinstance(optimizer, keras.optimizers.Optimizer) and callable(
            optimizer
        ):
            with tf.device(self.variable_device):
                optimizer = optimizer()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "optimizer must be a keras.optimizers.Optimizer or a zero-arg function "
                f"that makes one; received {optimizer!r}"
            )
        return optimizer

    def _build_from_batch(self, x: Any) -> None:
        """Creates a lazily built model's variables from one example."""
        with tf.device(self.variable_device):
            self.model(tf.nest.map_structure(lambda a: a[:1], x), training=False)
        self._finish_build()

    def _finish_build(self) -> None:
        if not self.optimizer.built:
            with tf.device(self.variable_device):
                self.optimizer.build(self.model.trainable_variables)
        self._check_placement(self.model.variables, "model")
        self._check_placement(self._slot_variables(), "optimizer slot")

    def _slot_variables(self) -> list:
        """The optimizer's variables except the scalars Keras made with it."""
        own = {id(self.optimizer.iterations), id(self.optimizer._learning_rate)}
        return [v for v in self.optimizer.variables if id(v) not in own]

    def _check_placement(self, variables: Sequence[Any], owner: str) -> None:
        for var in variables:
            device = var.handle.device
            if not same_device(device, self.variable_device):
                name = getattr(var, "path", var.name)
                raise ValueError(
                    f"{owner} variables must live on the variable device "
                    f"{self.variable_device}; received {name!r}"
                    f" on {device}. Pass a zero-arg function that builds the model "
                    "(towers builds it there), or build it inside "
                    f"`with tf.device({self.variable_device!r})`."
                )

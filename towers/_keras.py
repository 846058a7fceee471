"""The non-public parts of Keras towers uses, in one place.

Six jobs have no public call.

Loss terms. A Keras loss reduces its values over the batch it is given: a mean
over a tower's shard. To make T shards add up to the whole batch exactly, towers
needs the loss *before* its reduction, weighted exactly as Keras weights it
(sample weights, masks, their ranks matched), and what the reduction would
divide by. Keras has no public call that stops there; ``Loss.__call__`` does it
with the helpers imported below, and so does ``towers/step/losses.py``, through this
module only. A loss named by its function (``"binary_crossentropy"``) is
wrapped as Keras' ``compile`` wraps it (``LossFunctionWrapper``: the targets
squeezed or expanded to the predictions' rank).

Checked against Keras 3.15 (tests/step/test_losses.py compares every reduction, with
and without sample weights and masks, against Keras' own full-batch value).

The model's own loss. A model may override Keras' ``Model.compute_loss``, and
Keras' steps call it through ``Model._compute_loss``, which also calls an
override written before Keras 3.3 (it takes no ``training``). towers calls it
the same way, per tower (``towers/step/tower.py``).

Weights read on the tower's device. A layer may compile part of its call with
XLA (Keras' TensorFlow backend does for a grouped convolution on CPUs), and an
XLA computation cannot read a variable on another device. So each tower reads
the model's weights once, on its own device, and runs the model in a
``keras.StatelessScope`` that maps each weight to that tensor; an assignment
made in the scope (a seed generator's state, a layer's own counter) happens as
it would outside it (``Variable._direct_assign``), so the pass changes what it
changed before (``towers/step/tower.py``), unless the caller holds the seed
generators' states to hand them from tower to tower (``towers/step/once.py``).

Trainable changes. Freezing a layer sets its variables' ``trainable`` to False,
like a BatchNormalization's moving statistics, which are never trained; the
layers' own lists (``_trainable_variables``) still tell them apart. towers builds
the optimizer's slots for every variable a layer can train, so a layer unfrozen
between steps has its slots (tests/test_keras_parity.py).

Validation split. ``fit(validation_split=...)`` holds out the last examples as
Keras' own fit does, through its helper (``towers/training/data.py``).

"accuracy". Keras' ``compile`` turns the metric name ``"accuracy"`` into
binary, sparse categorical or categorical accuracy by the shapes of the targets
and predictions; towers uses the same rule (``towers/step/metrics.py``).
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.backend import get_keras_mask
from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.trainers.compile_utils import is_binary_or_sparse_categorical
from keras.src.trainers.data_adapters.array_slicing import train_validation_split

__all__ = [
    "apply_mask",
    "compute_loss",
    "get_keras_mask",
    "is_binary_or_sparse_categorical",
    "layers_of",
    "LossFunctionWrapper",
    "overrides",
    "ReadScope",
    "state_variables",
    "squeeze_or_expand_to_same_rank",
    "trainable_capable",
    "train_validation_split",
]


def overrides(model: Any, name: str) -> bool:
    """Whether ``model``'s class overrides Keras' ``Model.<name>`` (a hook such
    as ``compute_loss`` or ``train_step``).

    >>> class Own(keras.Model):
    ...     def compute_loss(self, *args, **kwargs):
    ...         return super().compute_loss(*args, **kwargs)
    >>> overrides(Own(), "compute_loss"), overrides(keras.Sequential(), "compute_loss")
    (True, False)
    """
    return getattr(type(model), name, None) is not getattr(keras.Model, name)


class ReadScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` (each weight reads as the tensor it is mapped
    to, ``add_loss`` collected) whose assignments happen too: each takes effect
    on the variable at once, and later reads in the scope see it.

    Args:
      mapping, collect_losses: as ``keras.StatelessScope``'s.
      held: variables whose assignments stay in the scope (later reads see
        them, the variable does not change): the caller reads their last values
        with ``get_current_value`` and assigns them itself.
    """

    def __init__(self, mapping: Any, collect_losses: bool = False, held: Any = ()):
        super().__init__(mapping, collect_losses=collect_losses)
        self._held = {id(v) for v in held}

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        variable, value = update
        if id(variable) not in self._held:
            variable._direct_assign(value)


def state_variables(model: keras.Model) -> list[Any]:
    """``model``'s variables that are not weights: its layers' seed generators'
    states, which a layer assigns as it draws (Dropout in training)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """``model.compute_loss`` on one batch, called as Keras' own steps call it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def layers_of(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer of ``model``, nested ones included, itself first."""
    return list(model._flatten_layers(include_self=True))


def trainable_capable(model: keras.Model) -> list[Any]:
    """The variables a layer of ``model`` created trainable, frozen or not, in
    the order of ``model.weights``."""
    ids = {id(v) for layer in layers_of(model) for v in layer._trainable_variables}
    return [v for v in model.weights if id(v) in ids]

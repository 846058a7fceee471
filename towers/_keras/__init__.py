"""The non-public parts of Keras towers uses, in one place (this package): jobs
with no public call.

Loss terms (``step/work/losses.py``): a loss *before* its reduction, weighted as
Keras weights it, and what the reduction divides by (``Loss.__call__``'s
helpers), checked against Keras 3.15 (tests/step/work/test_losses.py); a model's
own ``compute_loss`` called as Keras' steps call it, a loss spec checked by
Keras' own ``CompileLoss`` for its error; "accuracy" as a loss name by
Keras' rule of shapes.

Weights read on the tower's device: each tower runs the model in a
``keras.StatelessScope`` mapping each weight to the tensor it read
(``ReadScope``). A seed generator's state assigned there is assigned at once
unless the step holds the states every tower starts from (``step/rules/draws.py``);
any other assignment stays in the scope, assigned once by its aggregation
(``step/rules/state.py``). ``_trainable_variables`` tell a frozen layer's
variables from moving statistics; an optimizer's build for a layer unfrozen
later: ``towers/_keras/optimizers.py``.

Keras' rules a model relies on: ``call()`` called with ``training`` only
where it takes one, a compile without a loss keeping the ``CompileLoss``
made before (``_user_loss``). The global seed generator, which the
first-step check puts back as it was and which Keras keeps per thread: the
towers' threads share the caller's (:class:`GlobalSeed`). Input as Keras'
fit takes it: ``towers/_keras/inputs.py``.

What towers replaces while the towers are traced (BatchNormalization's
moments, a mixture of experts' load-balancing loss, a model's own step's
applies, assignments and metric updates): ``towers/_keras/patches.py``.
A layer's own loss terms, which each call clears: towers in lockstep put
theirs back in turn. The model's metrics (``step/metrics.py``), built as
Keras' fit builds them under a distribution strategy
(``Trainer._symbolic_build``), in its order.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import compute_output_spec, get_keras_mask
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional
from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR, SeedGenerator
from keras.src.trainers.compile_utils import (
    CompileLoss,
    CompileMetrics,
    is_binary_or_sparse_categorical,
)
from keras.src.utils.python_utils import pythonify_logs

# Imported here for the modules that use them (the names defined below are
# imported by name).
__all__ = [
    "LossFunctionWrapper",
    "apply_mask",
    "compute_output_spec",
    "get_keras_mask",
    "in_stateless_scope",
    "is_binary_or_sparse_categorical",
    "pythonify_logs",
    "squeeze_or_expand_to_same_rank",
]


class ReadScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` (each weight reads as the tensor it is mapped
    to, ``add_loss`` collected) that tells its assignments apart. Later reads
    in the scope see each assignment; besides:

    Args:
      mapping, collect_losses: as ``keras.StatelessScope``'s.
      held: variables whose assignments stay in the scope: the caller reads
        their last values with ``get_current_value`` and assigns them itself.
      passed: variables whose assignments also take effect on the variable at
        once (a seed generator's state, drawn on by the next tower).

    Attributes:
      assigned: every other variable the scope saw assigned, in order (by
        id): its assignments stay in the scope, for the caller to settle.
    """

    def __init__(
        self,
        mapping: Any,
        collect_losses: bool = False,
        held: Any = (),
        passed: Any = (),
    ):
        super().__init__(mapping, collect_losses=collect_losses)
        self._held = {id(v) for v in held}
        self._passed = {id(v) for v in passed}
        self.assigned: dict[int, Any] = {}

    def add_update(self, update: tuple) -> None:
        variable, value = update
        read = self.state_mapping.get(id(variable))
        if getattr(variable, "trainable", False) and read is not None:
            # One device's gradient reaches an assigned variable as if read
            # anew after the assignment, not through what it was assigned.
            value = _read_anew(read, value)
        super().add_update((variable, value))
        if id(variable) in self._passed:
            variable._direct_assign(value)
        elif id(variable) not in self._held:
            self.assigned.setdefault(id(variable), variable)

    @contextlib.contextmanager
    def forgetting(self) -> Iterator[None]:
        """Within, later reads see what is assigned; after, the scope holds
        what it held before (a loss a tower computes twice, or that another
        tower computes for the batch, updates the metrics once)."""
        mapping, assigned = dict(self.state_mapping), dict(self.assigned)
        try:
            yield
        finally:
            self.state_mapping.clear()
            self.state_mapping.update(mapping)
            self.assigned = assigned


@tf.custom_gradient
def _read_anew(read: Any, value: Any) -> Any:
    """``value``, whose gradient goes to ``read`` whole (and none to ``value``)."""

    def gradient(upstream: Any) -> tuple:
        return upstream, tf.zeros_like(value)

    return tf.identity(value), gradient


def loss_ids_kept(models: list[Any]) -> Callable[[], None]:
    """Returns the call that puts back each layer's ``_loss_ids`` of
    ``models`` as they are now (the module docstring), and its ``_losses``
    (what ``add_loss`` keeps outside a stateless scope: a model's own step)."""
    kept = [
        (layer, set(layer._loss_ids), list(layer._losses))
        for m in models
        for layer in layers_of(m)
    ]

    def put_back() -> None:
        for layer, ids, losses in kept:
            layer._loss_ids.clear()
            layer._loss_ids.update(ids)
            layer._losses[:] = losses

    return put_back


def is_seed_state(variable: Any) -> bool:
    """Whether ``variable`` is a Keras ``SeedGenerator``'s state (Keras names
    every one so), one the model does not track included: the global
    generator a draw with ``seed=None`` takes."""
    return getattr(variable, "name", None) == "seed_generator_state"


def compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """``model.compute_loss`` on one batch, called as Keras' own steps call it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def call_model(model: keras.Model, x: Any, training: bool) -> Any:
    """``model(x)`` as Keras' steps call it: with ``training`` only when its
    ``call()`` takes one (``Layer._call_has_training_arg``); else its layers
    take theirs from the call context (BatchNormalization infers)."""
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


def own_losses(layer: keras.layers.Layer) -> list[Any]:
    """The ``add_loss`` terms ``layer`` itself added in its last call (its
    sublayers' not included, nor weight regularisers)."""
    return layer._get_own_losses()


def layers_of(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer of ``model``, nested ones included, itself first."""
    return list(model._flatten_layers(include_self=True))


def trainable_capable(model: keras.Model) -> list[Any]:
    """The variables a layer of ``model`` created trainable, frozen or not, in
    the order of ``model.weights``."""
    ids = {id(v) for layer in layers_of(model) for v in layer._trainable_variables}
    return [v for v in model.weights if id(v) in ids]


def compile_arguments(model: Any) -> dict[str, Any]:
    """What ``model.compile`` was given, the objects as passed (its metrics
    included, registered for serialization or not); {} for a model that was
    not compiled.

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(loss="mse", metrics=["mae"])
    >>> args = compile_arguments(model)
    >>> args["loss"], args["metrics"]
    ('mse', ['mae'])
    """
    if not isinstance(model, keras.Model) or not getattr(model, "compiled", False):
        return {}
    arguments = dict(model._compile_config.config)
    kept = model._compile_loss
    if arguments.get("loss") is None and kept is not None:
        # Compiled again without a loss: Keras keeps the one compiled before.
        arguments["loss"] = kept._user_loss
        arguments["loss_weights"] = kept._user_loss_weights
    return arguments


def build_symbolically(model: Any, sample: Any) -> None:
    """Builds ``model``'s variables from ``sample``'s shapes and dtypes
    without running its call, as Keras' fit builds an unbuilt model
    (``Trainer._symbolic_build``): an assignment in the call changes nothing
    (a counter a subclassed model's call moves starts where Keras' does)."""

    def spec(leaf: Any) -> Any:
        if leaf is None:
            return None
        sparse = isinstance(leaf, tf.SparseTensor)
        return keras.KerasTensor(leaf.shape, leaf.dtype, sparse=sparse)

    compute_output_spec(model, tf.nest.map_structure(spec, sample), training=False)


def built_symbolically(model: Any) -> bool:
    """Whether ``model`` was built from symbolic inputs (a functional model, a
    ``Sequential`` given an ``Input``): its layers are built, variables or not."""
    return isinstance(model, Functional) or bool(getattr(model, "_functional", None))


def compiled_with(model: Any) -> Any:
    """What ``model.compile`` last made (a new object each compile), or None."""
    return getattr(model, "_compile_config", None)


def compile_loss_error(model: keras.Model, loss: Any, weights: Any) -> Any:
    """The error Keras' compiled loss raises for ``loss`` and ``weights`` on
    ``model``'s outputs when its fit builds it (a dict of losses naming
    outputs the model lacks), or None: a new one, built on the model's
    symbolic outputs, which stand for the targets too."""
    try:
        outputs = model.output
    except (AttributeError, ValueError):
        return None
    names = getattr(model, "output_names", None)
    try:
        CompileLoss(loss, weights, output_names=names).build(outputs, outputs)
    except (KeyError, ValueError) as error:
        return error
    return None


def loss_tracker(model: keras.Model) -> Any:
    """The compiled model's loss tracker (a ``Mean`` named ``"loss"``)."""
    return model._loss_tracker


def output_loss_trackers(model: keras.Model) -> list[Any]:
    """The compiled model's loss tracker per output (``<output>_loss``), for
    a model with several outputs that have a loss; built from a batch."""
    compile_loss = model._compile_loss
    return [] if compile_loss is None else list(compile_loss.metrics)


def build_compiled_metrics(model: keras.Model, batch: tuple) -> None:
    """Builds the compiled metrics and per-output loss trackers from the
    shapes of ``batch`` ``(x, y, sample_weight)``, nothing updated, as Keras'
    fit does under a distribution strategy (``Trainer._symbolic_build``); the
    variables are made under the current device scope. Not the optimizer:
    a fit with no strategy builds it at its first apply (an own train_step's
    may accumulate, towers/step/work/applies.py), towers' own step at its start."""
    optimizer = getattr(model, "optimizer", None)
    unbuilt = optimizer is not None and not optimizer.built
    if unbuilt:
        optimizer.built = True  # _symbolic_build then passes it by
    try:
        model._symbolic_build(data_batch=batch)
    finally:
        if unbuilt:
            optimizer.built = False


def compiled_metrics_unbuilt(model: keras.Model) -> bool:
    """Whether the compiled metrics or loss still wait for a batch's shapes."""
    parts = (model._compile_metrics, model._compile_loss)
    return any(part is not None and not part.built for part in parts)


def leaf_metrics(model: keras.Model) -> list[Any]:
    """``model.metrics`` with the compiled metrics expanded into each one
    (``CompileMetrics`` holds them), in Keras' order."""
    leaves = []
    for metric in model.metrics:
        if isinstance(metric, CompileMetrics):
            leaves.extend(metric.metrics)
        else:
            leaves.append(metric)
    return leaves


def metrics_in_order(model: keras.Model, logs: dict[str, Any]) -> Any:
    """``evaluate``'s list: the results in the order of the model's metrics,
    the loss alone when it is the only one (Keras' own rule)."""
    return model._flatten_metrics_in_order(logs)


@contextlib.contextmanager
def global_seed_kept() -> Iterator[None]:
    """Within, Keras' global seed generator may be made and drawn from
    (``seed=None``); after, it is as before: absent if it was, and Python's
    ``random``, which seeds a new one, where it was."""
    existed = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    python_random = random.getstate()
    try:
        yield
    finally:
        if existed is None:
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)
        random.setstate(python_random)


def global_seed_state() -> Any:
    """The state of Keras' global ``SeedGenerator`` (what a draw with
    ``seed=None`` takes), or None while there is none."""
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    return None if generator is None else generator.state


class GlobalSeed:
    """Keras' global seed generator (a ``seed=None`` draw's) for the threads
    that trace one step's towers. Keras keeps it per thread (``global_state``
    is a ``threading.local``): a tower's thread would make its own, from
    another seed. Each tower's is the caller's; where the caller has none,
    the first tower to draw makes it, on ``device``, eagerly, from Python's
    ``random`` as Keras' own trace would (one device makes it in its first
    trace too), and the caller keeps it after (:meth:`kept`)."""

    def __init__(self, device: str | None = None):
        self.device = device
        self.generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[None]:
        """Within (a tower's thread), ``seed=None`` draws take the caller's."""
        shared = self.generator or _Made(self)
        global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, shared)
        try:
            yield
        finally:
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)

    def made(self) -> Any:
        if self.generator is None:
            with tf.init_scope(), tf.device(self.device):
                self.generator = SeedGenerator()
        return self.generator

    def kept(self) -> None:
        """The caller's from now on (in the caller's thread, after)."""
        if self.generator is not None:
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, self.generator)


class _Made:
    """Keras' global seed generator, made at its first use."""

    def __init__(self, seed: GlobalSeed):
        self._seed = seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seed.made(), name)

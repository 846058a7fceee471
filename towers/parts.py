"""The step's parts, made from ``Towers``' arguments.

``Towers(...)`` resolves what it was given into the parts of the data path: a
placement (which builds the model and optimizer), the loss as per-output terms,
the update, the metrics, the workers of a cluster, and the ``Step`` that runs
them (``towers/step/step.py``). A model compiled with ``model.compile(...)`` brings
its own loss, loss weights, optimizer and metrics; what is passed explicitly wins.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Literal

import keras

from towers._keras import compile_arguments, compile_loss_error
from towers.cluster.cluster import Cluster, resolve_cluster
from towers.cluster.workers import join_workers
from towers.placement.base import Placement
from towers.placement.replicas import Independent, Replicated
from towers.placement.shared import Balanced, Central
from towers.placement.update import Update
from towers.step.metrics import Metrics
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.rules.coupled import CoupledLosses
from towers.step.run import xla
from towers.step.step import Step
from towers.step.work import outputs
from towers.step.work.builtin import BuiltIn
from towers.step.work.hooks import custom_hooks, kinds_of, overrides, refuse_with_hooks
from towers.step.work.losses import StepLoss
from towers.step.work.own import OwnStep
from towers.training.compiling import FROM_COMPILE, compile_model, given, option

PlacementName = Literal["central", "balanced", "replicated", "independent"]
PLACEMENTS: dict[str, type[Placement]] = {
    cls.name: cls for cls in (Central, Balanced, Replicated, Independent)
}


def join_cluster(cluster: Any, model: Any, optimizer: Any) -> Cluster | None:
    """``resolve_cluster``, with the usual reason it is too late named: a model or
    optimizer the script made before the engine (making one starts TensorFlow).
    """
    try:
        return resolve_cluster(cluster)
    except RuntimeError as error:
        made = [
            (what, obj)
            for what, obj in (("optimizer", optimizer), ("model", model))
            if isinstance(obj, (keras.optimizers.Optimizer, keras.Model))
        ]
        if "before TensorFlow initialises" not in str(error) or not made:
            raise
        what, obj = made[0]
        name = type(obj).__name__
        instead = (
            f"optimizer=lambda: keras.optimizers.{name}(...)"
            if what == "optimizer"
            else "model=build_model, a function that builds it"
        )
        raise RuntimeError(
            "the cluster must start before TensorFlow initialises, and making the "
            f"{what} started it: received the {what} {name}, made before "
            f"towers.Towers. Pass a zero-arg function instead ({instead}); towers "
            "makes it after the cluster has started."
        ) from None


def make_step(
    model: Any,
    loss: Any,
    optimizer: Any,
    devices: list[str],
    variable_device: str,
    reducer: Any,
    placement: str,
    cluster: Cluster | None,
    options: dict[str, Any],
) -> Step:
    """The step of an engine; ``options``: ``metrics``, ``weighted_metrics``,
    ``loss_weights``, ``moving_statistics``, ``batch_statistics``, ``on_nonfinite``,
    ``accumulate_steps``, ``jit_compile``, ``coupled_losses``,
    ``steps_per_execution``."""
    check_model(model)
    built = isinstance(model, keras.Model)  # else a builder: asked once it ran
    if not built and optimizer is FROM_COMPILE:
        # A builder's model brings the optimizer its compile made, once built.
        optimizer = _compiled_optimizer(lambda: where.models[-1])
    elif optimizer is FROM_COMPILE:
        optimizer = compile_arguments(model).get("optimizer")
    if placement not in PLACEMENTS:
        raise ValueError(
            f"unknown placement; received {placement!r}, expected one of "
            f"{list(PLACEMENTS)}"
        )
    where = PLACEMENTS[placement](devices, variable_device, reducer)
    where.build(model, optimizer)
    compiled = compile_arguments(where.model)
    own_loss, loss = _loss_of(where.model, loss, compiled, options["loss_weights"])
    trains = _trains(where, loss, own_loss)
    # What the model is compiled with: its own loss, when it computes it itself.
    compile_loss = compiled.get("loss") if own_loss else loss
    loss = None if loss is FROM_COMPILE else loss
    workers_count = cluster.num_workers if cluster is not None else 1
    coupled = CoupledLosses(
        where.model,
        len(devices) * workers_count,
        options.get("coupled_losses", "exact"),
        options["accumulate_steps"],
        len(devices),
    )
    # The whole batch's statistics, one device's, unless each tower keeps a
    # copy of its own (placement="independent": the zero-sync floor).
    statistics = options["batch_statistics"]
    if statistics is None:
        statistics = "tower" if len(where.models) > 1 else "global"
    moving = MovingStatistics(
        lambda: where.model, options["moving_statistics"], statistics
    )
    weights = option(options, compiled, "loss_weights")
    names = outputs.names_of(where.model)
    try:
        step_loss = StepLoss(loss, weights, names)
    except ValueError as error:
        if not trains or not _nested(loss, names or []):
            raise _with_keras_words(error, where.model, loss, weights) from None
        # Outputs and losses nested as only Keras' compile maps them (a dict
        # of lists, one output's loss in a list): Keras' compute_loss of the
        # whole batch, gathered (its per-output trackers see the batch's).
        step_loss, own_loss = StepLoss(None), True
        coupled.gather_compute_loss()
    hooks = custom_hooks(where.model)
    kinds = kinds_of(hooks)
    # A model's own train_step accumulates in its optimizers (applies.py).
    own_train = "train" in kinds
    update = Update(
        where.optimizer,
        variable_device,
        options["on_nonfinite"],
        1 if own_train else options["accumulate_steps"],
    )
    batch_norm = bool(moving.layers)
    where.refuse(update, batch_norm)
    if moving.meets and len(where.models) > 1:
        raise ValueError(
            "the whole batch's BatchNormalization statistics (batch_statistics="
            "'global', or a layer's synchronized=True) need the towers to share "
            "one model: use placement='central' or 'balanced', or batch_statistics="
            f"'tower' without synchronized layers; received placement={where.name!r}"
        )
    per_tower = not all(moving.whole_batch(layer) for layer in moving.layers)
    workers = join_workers(cluster, where, per_tower, variable_device)
    jit = xla.resolve(options.get("jit_compile"), where.model, devices)
    if trains and not own_train:
        compile_model(
            where.models,
            where.optimizers,
            compile_loss,
            options,
            jit.enabled,
            variable_device,
        )
    metrics = Metrics(lambda: where.model, variable_device)
    builtin = BuiltIn(step_loss, moving, update.loss_scale, own_loss, jit, coupled)
    builtin.inline = _tower_functions(options.get("tower_functions", "inline"))
    step = Step(where, builtin, update, metrics, moving, workers)
    if hooks:
        refuse_with_hooks(hooks, where, options, jit)
        step.own = OwnStep(
            where,
            step.runner,
            update,
            kinds,
            metrics,
            workers,
            moving,
            options["accumulate_steps"],
            step.tail,
        )
        if own_train and not own_loss:  # its own data to its model
            coupled.probed = []
    return step


def _with_keras_words(error: ValueError, model: Any, loss: Any, weights: Any):
    """``error`` with Keras' own words beside it, of the type Keras' fit
    raises (a ``KeyError`` for a dict output's unknown key), where Keras'
    compiled loss refuses the same spec."""
    theirs = compile_loss_error(model, loss, weights)
    if theirs is None:
        return error
    return type(theirs)(f"{error}. Keras: {theirs.args[0] if theirs.args else ''}")


def _nested(loss: Any, output_names: Any) -> bool:
    """Whether ``loss`` is nested past one loss per output (a list within the
    list, a dict of lists), or a structure for a model of one output: Keras'
    compile maps it, towers' per-output terms do not.

    >>> _nested(["mse", ["mae"]], ["a", "b"]), _nested({"a": "mse"}, ["a", "b"])
    (True, False)
    """
    if not isinstance(loss, (list, tuple, Mapping)):
        return False
    entries = loss.values() if isinstance(loss, Mapping) else loss
    deeper = any(isinstance(e, (list, tuple, Mapping)) for e in entries)
    return deeper or len(output_names or []) <= 1


def check_model(model: Any) -> None:
    """Refuses what is neither a Keras model nor a zero-arg function that
    builds one, by name (a layer, a function of inputs)."""
    if isinstance(model, keras.Model):
        return
    takes = None
    if callable(model) and not isinstance(model, keras.layers.Layer):
        try:
            inspect.signature(model).bind()
        except TypeError:
            takes = "a function that takes arguments"
        except ValueError:
            return  # no signature to read (a builtin): called as a builder
        else:
            return
    what = takes or (
        f"a {type(model).__name__} layer"
        if isinstance(model, keras.layers.Layer)
        else f"{type(model).__name__} {model!r}"
    )
    raise ValueError(
        "model must be a keras.Model, or a zero-argument function that builds "
        f"one; received {what}. Wrap a layer in a model (keras.Sequential([...]) "
        "or keras.Model(inputs, outputs)), or pass lambda: build(...)."
    )


def _trains(where: Placement, loss: Any, own_loss: bool) -> bool:
    """Whether the engine can train: it has an optimizer and a loss (given,
    compiled, or the model's own). A model that was not compiled, given
    neither, only predicts (``fit`` and ``evaluate`` then ask for them); so
    does one whose only loss is its own ``compute_loss`` (keras' Distiller,
    never compiled, predicts).

    Raises:
      ValueError: one of the two without the other.
    """
    has_optimizer = where.optimizer is not None
    has_loss = loss is not FROM_COMPILE or own_loss
    if has_optimizer == has_loss:
        return has_optimizer
    if own_loss:  # its own compute_loss, and no optimizer: it predicts
        return False
    name = "optimizer" if has_loss else "loss"
    raise ValueError(
        f"Towers needs a {name} to train: pass {name}=..., or a model compiled "
        f"with one (model.compile({name}=...)); received a model that was not "
        f"compiled and no {name}"
    )


def _loss_of(
    model: keras.Model, loss: Any, compiled: dict[str, Any], loss_weights: Any
) -> tuple[bool, Any]:
    """Whether the model computes its own loss, and the loss towers computes
    for it otherwise (None then): the argument, else what compile said
    (FROM_COMPILE when neither says)."""
    own = _own_loss(model, loss, loss_weights)
    return own, None if own else given(loss, compiled, "loss")


def _own_loss(model: keras.Model, loss: Any, loss_weights: Any) -> bool:
    """Whether the model computes its loss itself (it overrides Keras'
    ``compute_loss``, which every tower then calls: ``towers/step/work/builtin.py``).

    Raises:
      ValueError: the model overrides ``compute_loss`` and is given a loss
        too, which its override would not use.
    """
    if not overrides(model, "compute_loss"):
        return False
    given = [
        name
        for name, value in (("loss", loss), ("loss_weights", loss_weights))
        if value is not FROM_COMPILE and value is not None
    ]
    if given:
        raise ValueError(
            f"a {type(model).__name__} overrides compute_loss, which computes its "
            f"loss (from what model.compile said); received {' and '.join(given)} "
            "for Towers too, which it would not use. Pass them to model.compile."
        )
    return True


def _compiled_optimizer(last_built: Any) -> Any:
    """A zero-arg function (the placement calls it after building each model)
    that gives the optimizer the model just built was compiled with (None for
    a model that was not compiled)."""
    return lambda: compile_arguments(last_built()).get("optimizer")


def _tower_functions(value: Any) -> bool:
    """Whether the towers' passes are inlined in the step's graph
    (``Towers(tower_functions=...)``).

    >>> _tower_functions("call")
    False
    """
    if value not in ("inline", "call"):
        raise ValueError(
            f"tower_functions must be 'inline' or 'call'; received {value!r}"
        )
    return value == "inline"

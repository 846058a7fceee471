"""The check's float64 twin (``check.py``): where a mechanism shows at its
own size.

In float32 and 16 bits, rounding through a deep network at random init
reaches several per cent of a variable's change (a ReLU6 gate or a
BatchNormalization channel tipped one way on one device and the other on
the towers), so the check in the model's dtype can only refuse past that.
In float64 the same rounding sits near 1e-13. So where the model computes in
less, the check also runs on a twin: the model rebuilt from its config in
float64, its variables and optimizer's cast from the model's, trained by an
engine of the same options, and compared with the twin's own ``train_step``
on one device. Past two towers the twin runs two (the first tower's device
and the last's) on the rows of the first shard and the last, which two
towers cut into the same shards: a mechanism of the split shows there, and
a second trace of T towers would cost what the towers' own first step costs
(MobileNetV2 at 8 towers: 20 s to 12 s). Its one step is built without
Grappler, which would cost more than it saves on a graph run once. A
difference there past float64's tolerance is the towers' mechanism, not
rounding, and refuses the step at its size (0.1 % of a change is named). A
model its config cannot rebuild (a subclass without ``get_config``, a layer
that takes no float64) is said so once, and checked in its dtype alone.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers._keras import layers_of
from towers._runtime import unoptimised_calls
from towers.split import split_for_towers
from towers.step.rules.whole_batch import concat_rows
from towers.training.comparison import Comparison

# A variable this far apart (relative to its change) in the model's dtype
# may hide a mechanism of 0.1 % under rounding: the twin is asked. Nearer,
# every variable is one device's to a tenth of that.
TWIN_PAST = 1e-4
# The dtypes (and policies) the twin computes in float64 instead.
_LOW = frozenset(
    {"float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"}
)  # fmt: skip


class Twin:
    """``engine``'s model in float64, with an engine of the same towers.

    Attributes:
      engine: the twin's engine, or None where there is none (``why``).
      why: why the model has no twin (its config does not rebuild it).
    """

    def __init__(self, engine: Any):
        self.engine, self.why, self.step = None, None, engine.step
        try:
            self.engine = _twin_engine(engine)
        except Exception as error:  # noqa: BLE001 - checked in its dtype alone
            self.why = _said(error)
            self.warn(engine)

    def warn(self, engine: Any) -> None:
        warnings.warn(
            f"towers cannot check {type(engine.model).__name__}'s step in a "
            f"float64 twin ({self.why}): it is checked in "
            f"{engine.model.compute_dtype} alone, where rounding hides a "
            "difference below the check's tolerance there (15 % of a change in "
            "float32)",
            stacklevel=5,
        )

    def compare(self, engine: Any, batches: list[tuple], before: Any) -> Comparison:
        """The twin's step on ``batches`` (cast to float64) against its own
        ``train_step`` on one device, from ``engine``'s state ``before`` (a
        ``Kept``); nothing of either kept."""
        twin = self.engine
        _copy_state(engine, twin, before)
        rows = _two_shards(batches[0], engine.num_towers)
        batch = keras.tree.map_structure(_float64, rows)
        # A loss Keras makes lazily: float64; a step run once: no Grappler.
        with _float64_policy(), _unsaid(), unoptimised_calls():
            comparison = twin.check(*batch)
        if rows is not batches[0]:
            comparison.on = (
                f"on two towers, the rows of the first and the last of the "
                f"{engine.num_towers} towers' shards"
            )
        return comparison


def twin_comparison(
    engine: Any, batches: list[tuple], before: Any, comparison: Comparison
) -> Comparison | None:
    """The step on ``batches`` compared in ``engine``'s float64 twin (made
    at its first check, again after a compile), from ``engine``'s state
    ``before`` (a ``Kept``), where ``comparison`` (in the model's dtype)
    leaves room for a mechanism rounding could hide (a variable
    :data:`TWIN_PAST` apart) or finds one that rounding may have made, on
    two towers or more. None where there is no room, or no twin (said
    once). What differs in the model's dtype alone, where the twin's step
    is one device's, is rounding (``comparison.rounding``): an element
    whose gradient rounding tipped past the noise floor moves by the
    learning rate under Adam's first step, whatever its size. Not under a
    loss scale, which the twin has none of."""
    low = str(engine.model.compute_dtype) in _LOW
    if not low or engine.num_towers < 2:
        return None  # one tower splits nothing: no mechanism of the split
    if comparison.differs and _inner(engine.optimizer) is not engine.optimizer:
        return None  # a loss scale's mechanism is not the twin's to clear
    compared = [d for d in comparison.differences if not d.reported]
    if max([d.relative for d in compared], default=0.0) <= TWIN_PAST:
        return None
    twin = getattr(engine, "_twin", None)
    if twin is None or twin.step is not engine.step:
        twin = engine._twin = Twin(engine)
    if twin.engine is None:
        return None
    try:
        return twin.compare(engine, batches, before)
    except Exception as error:  # noqa: BLE001 - checked in its dtype alone
        twin.engine, twin.why = None, _said(error)
        twin.warn(engine)
        return None


def drop_twin(engine: Any) -> None:
    """``engine``'s twin dropped with its float64 copies on its devices (the
    next check that asks makes it again); one it has none of is kept, so
    that is said once."""
    twin = engine.__dict__.get("_twin")
    if twin is not None and twin.engine is not None:
        del engine._twin


def _twin_engine(engine: Any) -> Any:
    """A ``Towers`` of ``engine``'s devices and options on the model in
    float64, unchecked (it is the check)."""
    model = engine.model
    custom = _classes(model)
    optimizer = engine.placement.optimizer
    with _float64_policy(), _unsaid(), keras.saving.custom_object_scope(custom):
        twin = keras.saving.deserialize_keras_object(
            _as_float64(keras.saving.serialize_keras_object(model))
        )
        if not twin.built:
            twin.build_from_config(_as_float64(model.get_build_config()))
        config = model.get_compile_config() if model.compiled else None
        if config is not None:
            twin.compile_from_config(_as_float64(config))
        twin_optimizer = _deserialize(_inner(optimizer))
        arguments = dict(engine._arguments)
        if isinstance(arguments.get("loss"), keras.losses.Loss):
            arguments["loss"] = _deserialize(arguments["loss"])
        arguments.update(
            model=twin,
            optimizer=twin_optimizer,
            cluster=None,
            metrics=None,
            weighted_metrics=None,
            check_first_step=False,
            spot_checks=None,
            devices=_two_devices(engine.devices),
        )
        return type(engine)(**arguments)


def _two_devices(devices: list[str]) -> list[str]:
    """The first tower's device and the last's: the twin's two towers."""
    return devices if len(devices) <= 2 else [devices[0], devices[-1]]


def _two_shards(batch: tuple, towers: int) -> tuple:
    """Of ``batch``, the rows of the first tower's shard and the last
    working one's, which two towers split into the same shards.

    >>> x = np.arange(10)
    >>> _two_shards((x, x * 10), 4)[0].tolist()  # shards 3, 3, 2, 2
    [0, 1, 2, 8, 9]
    """
    shards = split_for_towers(batch, towers)
    working = shards.working()
    if towers <= 2 or len(working) < 2:
        return batch
    first, last = shards.parts[working[0]], shards.parts[working[-1]]
    return tuple(concat_rows([a, b]) for a, b in zip(first, last))


def _said(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:160]
    return f"{type(error).__name__}: {first}"


def _copy_state(engine: Any, twin: Any, before: Any) -> None:
    """``engine``'s model's trainable flags, and its and its optimizer's
    variables as ``before`` holds them, into ``twin``'s, cast."""
    values = {id(v): value for v, value in zip(before.variables, before.values)}
    value = lambda v: values[id(v)] if id(v) in values else v.numpy()  # noqa: E731
    pairs = zip(layers_of(engine.model), layers_of(twin.model), strict=True)
    for layer, twin_layer in pairs:
        twin_layer.trainable = layer.trainable
    for source, target in _pairs(engine.model.variables, twin.model.variables):
        target.assign(np.asarray(value(source)).astype(target.dtype))
    optimizer, twin_optimizer = _inner(engine.optimizer), _inner(twin.optimizer)
    if optimizer.built:
        if not twin_optimizer.built:
            twin_optimizer.build(twin.model.trainable_variables)
        for source, target in _pairs(optimizer.variables, twin_optimizer.variables):
            target.assign(np.asarray(value(source)).astype(target.dtype))


def _pairs(variables: list, twins: list) -> list[tuple]:
    """Each variable with its twin's, by path (a quantized layer rebuilt
    from its config makes its float8 scales before its kernel); in order
    where paths repeat."""
    by_path = {v.path: v for v in twins}
    if len(by_path) == len(twins) and sorted(by_path) == sorted(
        v.path for v in variables
    ):
        return [(v, by_path[v.path]) for v in variables]
    return list(zip(variables, twins, strict=True))


def _float64(value: Any) -> Any:
    """A batch's float leaf in float64; any other as it is."""
    if value is None:
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is not None and tf.as_dtype(dtype).is_floating:
        return tf.cast(value, tf.float64)
    return value


def _inner(optimizer: Any) -> Any:
    """The optimizer a loss scale wraps (float64 needs none), or itself."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _deserialize(thing: Any) -> Any:
    return keras.saving.deserialize_keras_object(
        _as_float64(keras.saving.serialize_keras_object(thing))
    )


def _classes(model: keras.Model) -> dict[str, type]:
    """The classes in ``model`` (its own, its layers'), by name, for its
    config to find them where they are not registered."""
    found: dict[str, type] = {}
    for layer in layers_of(model):
        found.setdefault(type(layer).__name__, type(layer))
    return found


def _as_float64(config: Any) -> Any:
    """``config`` with every float dtype policy and every ``dtype`` entry of
    a float in float64; any other string (a layer's argument that happens
    to read "float32") as it is."""
    if isinstance(config, dict):
        inner = config.get("config")
        if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy"):
            name = inner.get("name") if isinstance(inner, dict) else None
            if name in _LOW:
                return {**config, "config": {**inner, "name": "float64"}}
        if isinstance(inner, dict) and inner.get("source_name") in _LOW:
            # A quantized layer's policy (float8, int8): quantized from float64.
            return {**config, "config": {**inner, "source_name": "float64"}}
        return {
            key: "float64"
            if key == "dtype" and isinstance(value, str) and value in _LOW
            else _as_float64(value)
            for key, value in config.items()
        }
    if isinstance(config, list):
        return [_as_float64(value) for value in config]
    return config


@contextlib.contextmanager
def _unsaid() -> Iterator[None]:
    """The twin's warnings left unsaid: the model's own engine says each."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _float64_policy() -> Iterator[None]:
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)

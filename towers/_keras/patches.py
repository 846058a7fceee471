"""Where towers replaces what Keras does while the towers are traced, for want
of a public hook: the one patch point.

A :class:`Patch` replaces attributes of Keras' objects (an instance's method,
a class's, a module's function) while any tower is within it: the first
thread to enter replaces them, the last to leave restores them (towers
traced in lockstep enter together, each in its own thread). What is
replaced, and why:

- BatchNormalization's ``_moments``, and its own updates of its moving
  statistics (``step/rules/batchnorm.py``): the towers' moments are recorded or
  met, the statistics moved once a step;
- keras_hub's mixture-of-experts ``compute_load_balancing_loss``
  (``step/rules/coupled.py``): the whole batch's, when the towers meet;
- in a model's own step, Keras' optimizers' ``apply``, Keras variables'
  ``assign``, metrics' ``update_state`` and ``result``, and a model's
  ``compute_loss`` (``step/work/applies.py``, ``step/rules/assignments.py``,
  ``step/rules/whole_batch.py``): routed to where the towers meet; and
  ``tf.GradientTape.gradient`` (``step/work/applies.py``): a gradient handed
  in as a mean's, however the loss reads the batch;
- Keras' random draws (``step/rules/draws.py``), and TensorFlow's stateless
  uniform and normal draws under them: a tower draws its rows of the
  batch's numbers;
- Python's ``random`` functions (``random.choice``: AugMix picks each
  chain's operations so while it is traced; ``step/rules/places.py``): each
  tower's trace draws what one device's trace would;
- Keras' own ``fit``, ``evaluate`` and ``predict`` while a model's override
  of one runs (``training/overrides.py``): its ``super()`` call reaches
  towers'.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.python.ops import gen_random_ops, gen_stateless_random_ops_v2

from towers._keras.current import setting, this_tower

Replacement = tuple[Any, str, Any]  # (owner, attribute name, new value)
_ABSENT = object()  # the owner had no attribute of its own: delete on restore


class Patch:
    """Replacements made while any thread is within :meth:`applied`.

    Args:
      replacements: a zero-arg function giving ``(owner, name, value)``
        triples, asked at each first entry (the objects may have been rebuilt
        since: a balanced placement builds a lazily built model anew).

    Example:
      >>> import types
      >>> module = types.SimpleNamespace(twice=lambda v: 2 * v)
      >>> patch = Patch(lambda: [(module, "twice", lambda v: 3 * v)])
      >>> with patch.applied():
      ...     with patch.applied():  # a second tower's thread
      ...         inside = module.twice(1)
      ...     still = module.twice(1)
      >>> inside, still, module.twice(1)
      (3, 3, 2)
    """

    def __init__(self, replacements: Callable[[], list[Replacement]]):
        self._replacements = replacements
        self._lock, self._users = threading.Lock(), 0
        self._saved: list[Replacement] = []

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with self._lock:
            if not self._users:
                for owner, name, value in self._replacements():
                    self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
                    _set(owner, name, value)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    for owner, name, saved in reversed(self._saved):
                        _restore(owner, name, saved)
                    self._saved.clear()


def _set(owner: Any, name: str, value: Any) -> None:
    # Keras' own __setattr__ would track the value (a layer's, a variable's).
    setter = type.__setattr__ if isinstance(owner, type) else object.__setattr__
    setter(owner, name, value)


def _restore(owner: Any, name: str, saved: Any) -> None:
    if saved is not _ABSENT:
        _set(owner, name, saved)
    elif isinstance(owner, type):
        type.__delattr__(owner, name)
    else:
        object.__delattr__(owner, name)


def batch_norm_replacements(layer: Any, moments: Callable) -> list[Replacement]:
    """``layer`` (a BatchNormalization) takes its moments from
    ``moments(inputs, mask)`` and leaves its moving statistics alone in its
    call: a renorm layer moves them in one method, others assign their two
    variables (an assignment from outside its call, a step's EMA of them,
    stands)."""
    replacements = [(layer, "_moments", moments), *tracked_calls([layer])]
    if layer.renorm:
        return [*replacements, (layer, "_update_renorm_statistics", _dropped)]
    moving = (layer.moving_mean, layer.moving_variance)
    return [*replacements, *[(v, "assign", _kept_in_call(layer, v)) for v in moving]]


def tracked_calls(layers: list[Any]) -> list[Replacement]:
    """Each of ``layers``' ``call`` marks this thread as within it
    (:func:`calling`)."""

    def tracked(layer: Any) -> Callable:
        own = layer.call

        def call(*args: Any, **kwargs: Any) -> Any:
            with setting(calling=(*this_tower().calling, layer)):
                return own(*args, **kwargs)

        return call

    return [(layer, "call", tracked(layer)) for layer in layers]


def calling(layer: Any) -> bool:
    """Whether this thread is within ``layer``'s call (:func:`tracked_calls`)."""
    return any(x is layer for x in this_tower().calling)


def own_moments(layer: Any) -> Callable:
    """Keras' own moments of a BatchNormalization ``layer``: ``(inputs,
    mask) -> (mean, variance)``, ``mask`` broadcast over the last axis."""
    return type(layer)._moments.__get__(layer)


def reduction_axes(layer: Any) -> list[int]:
    """The axes a BatchNormalization ``layer`` takes its moments over."""
    return layer._reduction_axes


def move_renorm(layer: Any, mean: Any, variance: Any) -> None:
    """A renorm layer's own update of its renorm and moving statistics."""
    type(layer)._update_renorm_statistics(layer, mean, variance)


def assign(variable: Any, value: Any) -> Any:
    """Keras' own ``assign`` of ``variable``, past any replacement."""
    return type(variable).assign(variable, value)


def _dropped(*_: Any) -> None:
    """A layer's own update, dropped: towers makes it."""


def _kept_in_call(layer: Any, variable: Any) -> Callable:
    """``variable``'s assignment: dropped within ``layer``'s call (towers
    makes it), Keras' own elsewhere."""

    def assign(value: Any, *args: Any, **kwargs: Any) -> Any:
        if calling(layer):
            return value
        return type(variable).assign(variable, value, *args, **kwargs)

    return assign


def module_functions(modules: list[Any], name: str, wrap: Callable) -> Patch:
    """Each of ``modules``' function ``name`` replaced by ``wrap(its own)``."""
    return Patch(lambda: [(m, name, wrap(getattr(m, name))) for m in modules])


@contextlib.contextmanager
def routed_applies(route: Callable[..., Any]) -> Iterator[None]:
    """Within, Keras' optimizers' ``apply`` calls ``route(optimizer, grads,
    variables, apply)`` (``apply``: its own); so does ``apply_gradients``."""
    classes = (BaseOptimizer, keras.optimizers.LossScaleOptimizer)

    def routed(own: Callable) -> Callable:
        # Keras' own parameter names: a step may pass trainable_variables=.
        return lambda self, grads, trainable_variables=None: route(
            self, grads, trainable_variables, functools.partial(own, self)
        )

    patch = Patch(lambda: [(c, "apply", routed(c.__dict__["apply"])) for c in classes])
    with patch.applied():
        yield


@contextlib.contextmanager
def routed_gradients(route: Callable[..., Any]) -> Iterator[None]:
    """Within, ``tf.GradientTape.gradient(target, sources, ...)`` calls
    ``route(target, sources, gradient)`` (``gradient(target)``: the tape's
    own, with the call's other arguments)."""
    own = tf.GradientTape.gradient

    def routed(self: Any, target: Any, sources: Any, *args: Any, **kwargs) -> Any:
        def gradient(target: Any) -> Any:
            return own(self, target, sources, *args, **kwargs)

        return route(target, sources, gradient)

    with Patch(lambda: [(tf.GradientTape, "gradient", routed)]).applied():
        yield


# Keras' random functions of the backend, as its layers and keras.random call them.
DRAWS = ("normal", "uniform", "truncated_normal", "randint", "gamma", "binomial",
         "beta", "dropout", "categorical", "shuffle")  # fmt: skip


@contextlib.contextmanager
def routed_draws(route: Callable[..., Any]) -> Iterator[None]:
    """Within, Keras' random function ``name`` (``DRAWS``) calls ``route(name,
    own, args, kwargs)`` (``own``: Keras' own), and TensorFlow's stateful
    random op ``name`` (``STATEFUL``, whatever function made it) calls
    ``route("tf." + name, own, args, kwargs)``."""
    module = keras.src.backend.random

    def routed(name: str) -> Callable:
        own = getattr(module, name)
        return lambda *args, **kwargs: route(name, own, args, kwargs)

    def stateful(name: str) -> Callable:
        own = getattr(gen_random_ops, name)
        return lambda *args, **kwargs: route(f"tf.{name}", own, args, kwargs)

    def replacements() -> list[Replacement]:
        ops = [(_V2, name, _skipping(getattr(_V2, name))) for name in _COUNTED]
        tf_ops = [(gen_random_ops, name, stateful(name)) for name in STATEFUL]
        return [(module, name, routed(name)) for name in DRAWS] + ops + tf_ops

    # One patch per router: entered again within, it is not routed twice.
    with _DRAW_PATCHES.setdefault(route, Patch(replacements)).applied():
        yield


_DRAW_PATCHES: dict[Callable, Patch] = {}
# TensorFlow's stateful random ops (tf.random.normal, uniform, ...): each op
# draws from its own seed, which no tower can share with one device's.
STATEFUL = ("random_standard_normal", "random_uniform", "random_uniform_int",
            "truncated_normal", "parameterized_truncated_normal", "multinomial",
            "random_shuffle", "random_gamma", "random_poisson_v2")  # fmt: skip

# TensorFlow's stateless draws whose values follow from a key and a Philox
# counter by their place alone: one counter step gives four 32-bit words, a
# value of 64 bits takes two, any other one (TensorFlow's kernels and XLA's
# alike; tests/step/rules/test_draws.py holds them to Keras' draws).
_V2 = gen_stateless_random_ops_v2
_COUNTED = ("stateless_random_uniform_v2", "stateless_random_normal_v2",
            "stateless_random_uniform_int_v2")  # fmt: skip


@contextlib.contextmanager
def drawn_after(values: Any) -> Iterator[None]:
    """Within, this thread's next stateless uniform or normal draw (the one
    ``_COUNTED`` op a Keras draw makes) gives the values that follow the
    first ``values`` of the same draw made longer: a tower's rows of the
    batch's numbers, drawn alone (``step/rules/draws.py``). Only while
    :func:`routed_draws` is entered."""
    with setting(skip=values):
        yield


def _skipping(own: Callable) -> Callable:
    """``own`` (a ``_COUNTED`` op), its counter moved on as
    :func:`drawn_after` says."""

    def op(shape: Any, key: Any, counter: Any, alg: Any, **kwargs: Any) -> Any:
        tower = this_tower()
        values = tower.skip
        if values is None:
            return own(shape=shape, key=key, counter=counter, alg=alg, **kwargs)
        tower.skip = None  # one draw
        dtype = tf.as_dtype(kwargs.get("dtype") or kwargs["minval"].dtype)
        per_step = 2 if dtype.size == 8 else 4
        values = tf.cast(values, tf.int64)
        steps = tf.cast(values // per_step, tf.uint64)
        counter = counter + tf.stack([steps, tf.zeros([], tf.uint64)])
        size = tf.reduce_prod(tf.cast(shape, tf.int64), keepdims=True)
        drawn = own(  # a size XLA knows: the most values dropped, and the rest
            shape=size + per_step - 1, key=key, counter=counter, alg=alg, **kwargs
        )
        kept = tf.slice(drawn, tf.reshape(values % per_step, [1]), size)
        return tf.reshape(kept, tf.cast(shape, tf.int64))

    return op


@contextlib.contextmanager
def python_random_from(current: Callable[[], random.Random | None]) -> Iterator[None]:
    """Within, Python's ``random`` functions (``random.choice``, ...) draw from
    ``current()`` where it gives a generator, else from Python's own."""

    def routed(name: str, own: Callable) -> Callable:
        def draw(*args: Any, **kwargs: Any) -> Any:
            chosen = current()
            return (own if chosen is None else getattr(chosen, name))(*args, **kwargs)

        return draw

    def replacements() -> list[Replacement]:
        return [
            (random, name, routed(name, own))
            for name, own in vars(random).items()
            if inspect.ismethod(own) and isinstance(own.__self__, random.Random)
        ]

    with Patch(replacements).applied():
        yield


@contextlib.contextmanager
def routed_assignments(route: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Within, a Keras variable's ``assign`` (``assign_add`` and ``assign_sub``
    call it) calls ``route(variable, value, assign)`` (``assign``: Keras' own,
    bound); yields Keras' own, unbound, for the router's own assignments."""
    own = KerasVariable.assign

    def routed(self: Any, value: Any) -> Any:
        return route(self, value, functools.partial(own, self))

    with Patch(lambda: [(KerasVariable, "assign", routed)]).applied():
        yield own


def raw_assignments(variables: list[tf.Variable], assigned: Callable) -> list:
    """Patches of each raw tf.Variable's ``assign``, ``assign_add`` and
    ``assign_sub`` (``Patch``'s) calling ``assigned(variable, value)`` with
    the value it would take, from its ``value()``."""

    def by(variable: tf.Variable, change: Callable) -> Callable:
        def routed(value: Any, *args: Any, **kwargs: Any) -> Any:
            value = tf.convert_to_tensor(value, variable.dtype)
            return assigned(variable, change(variable.value(), value))

        return routed

    changes = {"assign": lambda old, new: new, "assign_add": lambda old, new: old + new}
    changes["assign_sub"] = lambda old, new: old - new
    return [(v, name, by(v, c)) for v in variables for name, c in changes.items()]


@contextlib.contextmanager
def routed_calls(objects: list[Any], name: str, route: Callable) -> Iterator[None]:
    """Within, each of ``objects``' method ``name`` (a metric's
    ``update_state``, a model's ``compute_loss``) calls ``route(obj, own,
    args, kwargs)`` (``own``: its own, bound)."""

    def routed(obj: Any) -> Callable:
        own = getattr(type(obj), name).__get__(obj)
        return lambda *args, **kwargs: route(obj, own, args, kwargs)

    with Patch(lambda: [(obj, name, routed(obj)) for obj in objects]).applied():
        yield


def keras_trainer_method(name: str) -> tuple[type, Any]:
    """The class of Keras whose ``name`` (``fit``, ``evaluate``, ``predict``)
    a model's ``super().name`` reaches, and that method."""
    own = getattr(keras.Model, name)
    owner = next(c for c in keras.Model.__mro__ if vars(c).get(name) is own)
    return owner, own


@contextlib.contextmanager
def super_reaching(model: Any, name: str, call: Callable[..., Any]) -> Iterator[None]:
    """Within, Keras' own ``name`` (``fit``, ``evaluate``, ``predict``) called
    on ``model`` (a ``super().name(...)`` in its override) is ``call``; on any
    other model, Keras' own still."""
    owner, own = keras_trainer_method(name)

    @functools.wraps(own)
    def reaching(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is model:
            return call(*args, **kwargs)
        return own(self, *args, **kwargs)

    with Patch(lambda: [(owner, name, reaching)]).applied():
        yield

"""A model that overrides Keras' ``fit``, ``evaluate`` or ``predict`` itself.

keras.io's masked language model overrides ``evaluate`` to tokenize strings
before it calls ``super().evaluate(...)``; a Keras user who moves such a
model over expects the override to run. So ``Towers.fit``, ``evaluate`` and
``predict`` call the model's own method, and its ``super()`` call reaches
towers' (``_keras/patches.py``: ``super_reaching``) with whatever arguments
the override passes. An override that never calls ``super()`` runs alone, as
it does under Keras.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from towers._keras.patches import keras_trainer_method, super_reaching


def overrides_keras(model: Any, name: str) -> bool:
    """Whether ``model``'s class defines its own ``name`` over Keras'.

    >>> import keras
    >>> class Tokenizing(keras.Model):
    ...     def evaluate(self, x=None, *args, **kwargs):
    ...         return super().evaluate(x, *args, **kwargs)
    >>> overrides_keras(Tokenizing(), "evaluate"), overrides_keras(Tokenizing(), "fit")
    (True, False)
    """
    return getattr(type(model), name, None) is not keras_trainer_method(name)[1]


def through_override(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a ``Trainer``'s ``fit``, ``evaluate`` or ``predict``) run
    through the model's override of it, if it has one: the override is
    called, and its ``super()`` call runs ``method``."""
    name = method.__name__

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        model = engine.model
        inside = engine.__dict__.setdefault("_in_override", set())
        if name in inside or not overrides_keras(model, name):
            return method(engine, *args, **kwargs)

        def towers_own(*args: Any, **kwargs: Any) -> Any:
            return method(engine, *args, **kwargs)

        inside.add(name)
        try:
            with super_reaching(model, name, towers_own):
                return getattr(model, name)(*args, **kwargs)
        finally:
            inside.discard(name)

    return run

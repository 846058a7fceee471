"""A model compiled again while its engine is kept: the engine takes it up.

Keras' own ``fit``, ``evaluate`` and ``predict`` read the model's compile as
it is when they are called: a fine-tuning script unfreezes layers, compiles
again with a smaller learning rate and fits on. An engine made before that
compile would go on with the first compile's optimizer, loss and metrics, in
silence; so each of its calls first takes the new compile up.
"""

from __future__ import annotations

import inspect
from typing import Any

from towers._keras import compiled_with


def remember_compile(engine: Any, arguments: dict[str, Any]) -> None:
    """Keeps what ``engine`` was made with (its ``__init__``'s ``arguments``,
    its locals at the end: the parameters are not rebound) and what the
    model's compile had made then."""
    names = list(inspect.signature(type(engine).__init__).parameters)[1:]
    engine._arguments = {name: arguments[name] for name in names}
    engine._compiled_with = compiled_with(engine.model)


def follow_compile(engine: Any) -> None:
    """Makes ``engine`` again from the arguments it was made with, on the
    same model, if the model was compiled since (``engine._compiled_with``,
    what its compile made then; ``engine._arguments``, what ``Towers`` was
    given: a loss or optimizer given there still wins over the compile's).

    >>> import keras, towers
    >>> eng = towers.Towers(make_engine().model, devices=["/cpu:0", "/cpu:1"])
    >>> eng.model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mae")
    >>> follow_compile(eng)
    >>> x, y = np.zeros((4, 3), "f4"), np.full((4, 1), 2.0, "f4")  # errors of 2
    >>> eng.evaluate(x, y, verbose=0), float(eng.optimizer.learning_rate)
    (2.0, 0.5)

    Raises:
      ValueError: in a cluster, where every worker would have to make its
        engine again together: make a new ``Towers`` on each instead.
    """
    if compiled_with(engine.model) is engine._compiled_with:
        return
    if engine.cluster is not None:
        raise ValueError(
            "the model was compiled again after its Towers engine was made; "
            "in a cluster make a new towers.Towers(model, ...) on every worker"
        )
    engine.__init__(**dict(engine._arguments, model=engine.model))

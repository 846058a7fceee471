"""Phase times of one tower step, each phase timed as its own compiled function.

The step's phases overlap when it runs as one function, so subtracting times says
little. Instead each phase runs alone on the same tensors the step would give it:
towers' forward + backward, the combine, and the apply. They are the step's own
phases (``Step.compute``, ``combine`` and ``apply``, ``towers/step/step.py``),
whatever the placement.
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

from towers.training.compiled import traced


def time_phases(engine: Any, x: Any, y: Any, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per call of each phase, and of the whole step, on ``(x, y)``.

    The apply phase and the full step update the model: call this when training is
    over, or on a copy.

    Args:
      engine: a ``towers.Towers``.
      x, y: one batch.

    Returns:
      ``{"compute": ms, "combine": ms, "apply": ms, "step": ms}``.
    """
    x, y, _ = engine.prepare(x, y)
    step = engine.step
    weight = tf.constant(float(len(y)))
    # Tower t's variables (the same shared ones, or its copy's).
    variables = [
        list(engine.placement.model_of(t).trainable_variables)
        for t in range(engine.num_towers)
    ]

    # Each phase captures its inputs rather than taking them as arguments: passing a
    # nest of dozens of tensors per call would time Python, not the phase. Each is
    # traced as the engine traces its step (no AutoGraph).
    @traced
    def compute():
        return _tower_grads(step, x, y)

    tower_grads = compute()

    @traced
    def combine():
        return step.combine(tower_grads)

    grads = combine()

    @traced
    def apply():
        step.apply(grads, variables, [], weight)
        return step.update.steps

    return {
        "compute": _time(compute, repeats),
        "combine": _time(combine, repeats),
        "apply": _time(apply, repeats),
        "step": _time(lambda: engine.train_step(x, y), repeats),
    }


def gradient_bytes(engine: Any, x: Any, y: Any) -> float:
    """Bytes one tower hands to the combine per step, averaged over towers.

    Dense gradients count their elements at the reducer's wire dtype (half, for a
    bf16/fp16 cast); IndexedSlices count their values and indices, as they travel,
    except under a placement that all-reduces them dense (replicated).
    """
    x, y, _ = engine.prepare(x, y)
    tower_grads = traced(lambda: _tower_grads(engine.step, x, y))()
    wire = getattr(engine.reducer, "wire_dtype", None)
    dense = engine.placement.sends_slices_dense
    total = 0
    for grads in tower_grads:
        for grad in grads:
            if isinstance(grad, tf.IndexedSlices) and dense:
                total += int(tf.reduce_prod(grad.dense_shape)) * grad.values.dtype.size
            elif isinstance(grad, tf.IndexedSlices):
                total += _nbytes(grad.values) + _nbytes(grad.indices)
            elif grad is not None:
                size = (wire or grad.dtype).size
                total += grad.shape.num_elements() * size
    return total / len(tower_grads)


def _tower_grads(step: Any, x: Any, y: Any) -> list[list[Any]]:
    """``tower_grads[t][v]`` of every working tower, as the step computes them."""
    return [result.grads for result in step.compute(step.split(x, y))]


def _nbytes(tensor: tf.Tensor) -> int:
    return int(tf.size(tensor)) * tensor.dtype.size


def _time(run, repeats: int) -> float:
    for _ in range(3):  # trace and warm up
        tf.nest.map_structure(_read, run())
    started = time.perf_counter()
    for _ in range(repeats):
        result = run()
    tf.nest.map_structure(_read, result)
    return 1e3 * (time.perf_counter() - started) / repeats


def _read(value: Any) -> None:
    if hasattr(value, "numpy"):
        value.numpy()

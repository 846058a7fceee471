"""One tower's forward and backward passes, traced once and run on every tower.

Every tower of a shared model runs the same code on a shard of the same shape
(split sizes differ by at most one), so tracing each tower anew (the model's
whole forward and backward pass, T times) is work a user waits for before the
first step. Instead the tower's work is one ``tf.function``, traced once per
shard shape (at most two), and called under each tower's device: TensorFlow
inlines the calls into the step's graph, each call's ops on its tower's
device, the same graph a trace per tower builds.

A tower's loss divides by the whole step's divisor (``towers/tower.py``), which
one tower knows when it follows from the step's examples: ``D_o = k_o * B``
for Keras' default reductions, ``k_o`` being the tower's loss values per
example. When a divisor comes from sample weights or a mask, every tower's
pass is needed first, and :func:`compute` says so (None): the step then traces
tower by tower (``Step.compute``).

A layer that draws random numbers (Dropout in training) assigns its seed
generator's state as it draws. Assigned inside the function, that state would
order the calls: TensorFlow runs a call that writes a variable after the call
before it that also writes it, so tower 1 would wait for tower 0. The states are
read once before the calls instead, handed from each tower's call to the next
(tower ``t`` starts where tower ``t - 1`` ended, as a trace per tower does: the
same draws), and assigned once after the last. A state only depends on the
state before it, so no tower waits for another's work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers._keras import state_variables
from towers.split import Shards, batch_size_of
from towers.tower import Tower, TowerResult


class _NeedsEveryTower(Exception):
    """A divisor of the step needs every tower's forward pass."""


def shareable(placement: Any, shards: Shards, working: list[int]) -> bool:
    """Whether the working towers can run one traced function: they share one
    model and the step's shard sizes are known at trace time."""
    models = {id(placement.model_of(t)) for t in working}
    return len(working) > 1 and len(models) == 1 and shards.sizes is not None


def compute(
    placement: Any,
    tower: Tower,
    shards: Shards,
    working: list[int],
    divisors_of: Callable[[list], list[Any]],
) -> list[TowerResult] | None:
    """``Step.compute`` with one trace for every tower: each working tower's
    loss share and gradients, on its device; None if a divisor of the step
    needs every tower's forward pass.

    ``divisors_of(passes)``: the step's divisors of ``passes`` (with its checks);
    given one tower's pass, that tower's own.
    """
    model = placement.model_of(working[0])
    examples = shards.normaliser
    traced: dict[int, TowerResult] = {}  # per shard size, the traced result

    def one_tower(x: Any, y: Any, sample_weight: Any, states: list) -> dict:
        tower_pass = tower.forward(model, x, y, sample_weight, examples, states)
        size = batch_size_of(x)
        own = divisors_of([tower_pass])
        divisors = [
            _step_divisor(term, d, size, examples)
            for term, d in zip(tower_pass.terms, own)
        ]
        result = tower.gradients(tower_pass, divisors)
        traced[size] = result
        return {**_tensors(result), "states": tower_pass.states}

    function = tf.function(one_tower, autograph=False)
    held = state_variables(model)
    states = [tf.identity(v) for v in held]
    results = []
    try:
        for t in working:
            x, y, sample_weight = shards.parts[t]
            with tf.device(placement.devices[t]), tf.name_scope(f"tower_{t}"):
                out = function(x, y, sample_weight, states)
            states = out["states"]
            results.append(_result(traced[shards.sizes[t]], out))
    except _NeedsEveryTower:
        return None
    for variable, value in zip(held, states):
        variable.assign(value)
    return results


def _step_divisor(term: Any, divisor: Any, size: int, examples: Any) -> Any:
    """The step's divisor of ``term`` from this tower's: ``k * B`` when it is
    ``k`` per example (exact: integers), none for a sum."""
    if divisor is None:
        return None
    if term.kind != "examples" or not isinstance(divisor, int):
        raise _NeedsEveryTower
    return divisor // size * examples


def _tensors(result: TowerResult) -> dict[str, Any]:
    """What a traced tower hands out of its function: the result's tensors."""
    return {
        "loss": result.loss,
        "predictions": result.predictions,
        "grads": result.grads,
        "moments": result.moments,
        "totals": [term.total for term in result.terms],
        "extra": result.extra,
        "output_losses": result.output_losses,
    }


def _result(traced: TowerResult, out: dict[str, Any]) -> TowerResult:
    """The traced result with one call's tensors (the rest is static)."""
    terms = [
        dataclasses.replace(term, total=total)
        for term, total in zip(traced.terms, out["totals"])
    ]
    return dataclasses.replace(
        traced,
        loss=out["loss"],
        predictions=out["predictions"],
        grads=out["grads"],
        moments=out["moments"],
        terms=terms,
        extra=out["extra"],
        output_losses=out["output_losses"],
    )

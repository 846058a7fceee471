"""Global batch statistics: each tower's pass in phases, the towers' sums
between them.

With ``batch_statistics="global"`` the towers meet inside their pass: every
BatchNormalization layer sums its moments over the towers twice on the way
forward and its upstream gradients once on the way back
(``towers/step/batchnorm.py``). One XLA computation per tower cannot stop for
that, so the tower's pass (forward, divisors, backward) is traced once and cut
where the towers meet (``towers/step/cut.py``), each phase one XLA
computation::

    tower t:  [phase 0] -> sum -> [phase 1] -> sum -> ... -> [phase K]
                           ^ every tower's value     ^ every tower's upstream

The step calls each phase of every working tower on the tower's device, in
rank order; between phases, each sum's values are added on every tower's
device (``tf.add_n`` in rank order, as the lockstep does), then over the
workers in a cluster. The phases hold the ops a lockstep trace makes, cut
where its towers would wait: one device's numbers with
``batch_statistics="global"``. Towers with shards of one shape call the same
functions (one trace per shard shape, as in ``towers/step/once.py``).

Without XLA the same phases are plain functions, inlined into the step's
graph: the tower's pass is traced once per shard shape instead of once per
tower in lockstep, which at 8 towers was most of the first step's extra time
over tower statistics. A pass that cannot be cut so (traces that differ
with the shard's shape) falls back to the lockstep
(``towers/step/lockstep.py``), which traces every tower; so does a step whose
towers gather a loss's rows (``towers/step/gathered.py``), since the cut
knows sums only. Random draws are one device's (``towers/step/draws.py``):
every tower starts from the step's seed states and draws its rows of the
whole batch's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.split import Shards
from towers.step import cut, draws, lockstep, meetings, once, xla
from towers.step.cut import Plan
from towers.step.tower import Tower, TowerResult


def run(
    plans: list[Plan],
    calls: list[tuple],
    devices: list[str],
    ranks: list[int],
    across: Callable[[tf.Tensor, bool], tf.Tensor] | None = None,
) -> list[Any]:
    """Every tower's pass, phase by phase: ``plans[i]`` called with
    ``calls[i]`` (its ``trace`` arguments' structure) on ``devices[i]``
    (named scope ``tower_{ranks[i]}``), the towers' sums between phases.
    ``across(value, backward)``: the towers' sum summed over the workers.
    Returns each tower's result, as ``work`` returned it.

    Raises:
      Uncuttable: the towers' passes meet at different phases (their shards'
        shapes made the traces differ).
    """
    _check_alike(plans)
    values = [
        dict(zip(plan.inputs, cut.tensors_of(args) + plan.captured))
        for plan, args in zip(plans, calls)
    ]
    phases = max(len(plan.phases) for plan in plans)
    for k in range(phases):
        for i, (plan, known) in enumerate(zip(plans, values)):
            phase = plan.phases[k] if k < len(plan.phases) else None
            if phase is None:
                continue
            with tf.device(devices[i]), tf.name_scope(f"tower_{ranks[i]}"):
                outputs = phase.function(*[known[name] for name in phase.inputs])
            known.update(zip(phase.outputs, outputs))
        for c, exchange in enumerate(plans[0].exchanges):
            if exchange.phase != k + 1:
                continue
            handed = [_value(plan, known, plan.exchanges[c].value.name)
                      for plan, known in zip(plans, values)]  # fmt: skip
            for plan, known, total in zip(
                plans, values, _sums(handed, devices, across, exchange.backward)
            ):
                known[plan.exchanges[c].result.name] = total
    return [
        cut.join(plan.skeleton, [_value(plan, known, name) for name in plan.results])
        for plan, known in zip(plans, values)
    ]


class Uncuttable(ValueError):
    """The towers' passes cannot run as one traced pass cut into phases."""


def compute(
    placement: Any,
    tower: Tower,
    shards: Shards,
    working: list[int],
    divisors_of: Callable[[list], list[Any]],
    workers: Any = None,
    weight_of: Callable[[list], Any] | None = None,
) -> list[TowerResult]:
    """The runner's ``"phases"`` (``towers/step/runner.py``): each working
    tower's loss share and gradients, its pass cut where the towers meet.

    ``divisors_of(passes)``: the step's checks on the towers' passes (given
    one). A divisor from sample weights or a mask is summed over the towers
    as the statistics are; one that is the examples times a constant follows
    from the tower's own (``towers/step/once.py``). Every tower starts from
    the step's seed states, as in ``towers/step/once.py``.

    Raises:
      Uncuttable: the pass cannot be cut so (the runner then takes turns).
    """
    model = placement.model_of(working[0])
    traced: list[Any] = []
    work = once.tower_pass(tower, model, shards, divisors_of, _step_divisor, traced)

    across, weight = lockstep.across_workers(workers)
    starts = draws.Starts([model])
    states = starts.of(model)
    scale = tower.loss_scale()
    plans: dict[tuple, Plan] = {}
    chosen, calls = [], []
    firsts = draws.first_rows(shards)
    for t in working:
        x, y, sample_weight = shards.parts[t]
        with tf.device(placement.devices[t]), tf.name_scope(f"tower_{t}"):
            weights = xla.read_weights(model)
            first = tf.cast(firsts[t], tf.int32)
        args = (x, y, sample_weight, first, states, weights, scale)
        key = xla.signature(args)
        if key not in plans:
            with tf.name_scope(f"tower_{t}"):
                plans[key] = cut.trace(work, args, tower.jit.enabled)
        chosen.append(plans[key])
        calls.append(args)
    if workers is not None:
        weight["examples"] = weight_of(traced[:1])
    devices = [placement.devices[t] for t in working]
    outputs = run(chosen, calls, devices, working, across)
    starts.ended(model, outputs[0][1])
    starts.settle()
    return [result for result, _ in outputs]


def _value(plan: Plan, known: dict[str, Any], name: str) -> Any:
    """What the traced tensor ``name`` is in the run: a constant's value, or
    what an input, a sum or a phase made."""
    return plan.constants[name] if name in plan.constants else known[name]


def _sums(
    handed: list[tf.Tensor],
    devices: list[str],
    across: Callable[[tf.Tensor, bool], tf.Tensor] | None,
    backward: bool,
) -> list[tf.Tensor]:
    """The towers' sum of ``handed`` on each tower's device (in rank order);
    with ``across``, tower 0's sum summed over the workers, read by every
    tower."""
    if across is None:
        sums = []
        for device in devices:
            with tf.device(device), tf.name_scope("towers_sum"):
                sums.append(tf.add_n(handed))
        return sums
    with tf.device(devices[0]), tf.name_scope("towers_sum"):
        total = across(tf.add_n(handed), backward)
    return [total] * len(devices)


def _check_alike(plans: list[Plan]) -> None:
    first = [(e.phase, e.backward, e.value.dtype) for e in plans[0].exchanges]
    for plan in plans[1:]:
        other = [(e.phase, e.backward, e.value.dtype) for e in plan.exchanges]
        if other != first:
            raise Uncuttable(
                "batch_statistics='global' with jit_compile: the towers' passes "
                f"meet {len(first)} and {len(other)} times, or at different "
                "phases, on shards of different shapes; received a model whose "
                "trace depends on its batch size. Use jit_compile=False."
            )


def _step_divisor(term: Any, divisor: Any, size: Any, examples: Any) -> Any:
    """The step's divisor of ``term`` from this tower's: ``k * B`` when it is
    ``k`` per example (exact: integers), none for a sum, else the towers' sum
    of theirs (an exchange)."""
    if divisor is None:
        return None
    if term.kind == "examples" and isinstance(divisor, int) and isinstance(size, int):
        return divisor // size * examples if size else divisor  # empty: 0, as summed
    return meetings.total(tf.cast(divisor, term.total.dtype))

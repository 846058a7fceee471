"""A tower's pass traced once per model and shard shape and run on every
tower's device, phase by phase where the towers meet.

Where nobody meets, the pass is one phase, inlined per tower (with XLA one
computation each); where the towers meet by sums (global batch moments, a
mixture of experts' sums, a divisor no tower knows alone) or a model's own
step meets at an action, the pass is cut there (``cut.py``) and :func:`run`
calls each phase of every tower in rank order, the sums and actions between
phases. A pass that cannot run so raises ``seats.Unserved``: the runner
takes the next way. Every call starts from the step's seed states."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import keras
import tensorflow as tf

from towers.combine import in_dtype
from towers.placement.base import Placement
from towers.split import Shards, batch_size_of
from towers.step.rules import draws, places
from towers.step.rules.forms import Form
from towers.step.run import cut, seats, xla
from towers.step.run.cut import Plan
from towers.step.run.seats import Across, Action
from towers.step.work.builtin import BuiltIn, TowerResult


def shareable(placement: Placement, shards: Shards, working: list[int]) -> bool:
    """Whether the working towers can run one traced pass without XLA: they
    share one model and the step's shard sizes are known at trace time."""
    models = {id(placement.model_of(t)) for t in working}
    return len(working) > 1 and len(models) == 1 and shards.sizes is not None


def run(
    plans: list[Plan],
    calls: list[tuple],
    devices: list[str],
    ranks: list[int],
    across: Callable[[tf.Tensor, bool], tf.Tensor] | None = None,
) -> list[Any]:
    """Every tower's pass, phase by phase: ``plans[i]`` called with ``calls[i]``
    on ``devices[i]`` (scope ``tower_{ranks[i]}``), the sums (over the
    workers too, by ``across``) and actions between. Returns each tower's
    result, as its work returned it.

    Raises:
      seats.Unserved: the towers' passes meet at different phases."""
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
        for c, meeting in enumerate(plans[0].meetings):
            if meeting.phase != k + 1:
                continue
            if isinstance(meeting, Action):  # run once, as the first tower
                handed = [_handed(plan.meetings[c].value, plan, known)
                          for plan, known in zip(plans, values)]  # fmt: skip
                with tf.device(devices[0]), tf.name_scope(f"tower_{ranks[0]}"):
                    with seats.seated(None):
                        meeting.action(handed)
                continue
            handed = [_value(plan, known, plan.meetings[c].value.name)
                      for plan, known in zip(plans, values)]  # fmt: skip
            for plan, known, total in zip(
                plans, values, _sums(handed, devices, across, meeting.backward)
            ):
                known[plan.meetings[c].result.name] = total
    return [
        cut.join(plan.skeleton, [_value(plan, known, name) for name in plan.results])
        for plan, known in zip(plans, values)
    ]


def compute(
    placement: Placement,
    builtin: BuiltIn,
    shards: Shards,
    working: list[int],
    divisors_of: Callable[[list], list[Any]],
    across: Across | None = None,
    weight_of: Callable[[list], Any] | None = None,
    meets: bool = True,
) -> list[TowerResult]:
    """The built-in pass's ``"shared"`` and ``"phases"`` ways: each working
    tower's loss share and gradients. ``divisors_of(passes)``: the step's
    divisors; ``weight_of(passes)``: this worker's weight in its backward
    sums; ``meets``: the towers were sent to meet."""
    models = [placement.model_of(t) for t in working]
    traced: list[Any] = []
    starts = draws.Starts(models)
    scale = builtin.loss_scale()
    firsts, total = places.first_rows(shards), places.batch_rows()

    def args_of(t: int) -> tuple:
        x, y, sample_weight = shards.parts[t]
        model = placement.model_of(t)
        with tf.device(placement.devices[t]), tf.name_scope(f"tower_{t}"):
            weights = xla.read_weights(model)
            first = tf.cast(firsts[t], tf.int32)
        return (x, y, sample_weight, first, total, starts.of(model), weights, scale)

    def pass_of(model: keras.Model) -> Callable[..., tuple]:
        return tower_pass(builtin, model, shards, divisors_of, traced)

    trace = dict(jit=builtin.jit.enabled, inline=builtin.inline, meets=meets)
    plans, calls = plans_for(placement, working, args_of, pass_of, **trace)
    if across is not None:
        across.weight = weight_of(traced[:1])
    devices = [placement.devices[t] for t in working]
    outputs = run(plans, calls, devices, working, across)
    for model, (_, ended) in zip(models, outputs):
        starts.ended(model, ended)
    starts.settle()
    return [result for result, _ in outputs]


def own(
    placement: Placement,
    shards: Shards,
    working: list[int],
    work: Callable[..., Any],
    weights: list[Any],
    across: Across | None,
    inline: bool,
) -> list[Any]:
    """A model's own step, ``work(model, x, y, sw, B)``, on every working tower
    (``weights``: their shares), cut where the towers meet."""
    firsts = places.first_rows(shards)
    shares = dict(zip(working, weights))

    def args_of(t: int) -> tuple:
        x, y, sample_weight = shards.parts[t]
        with tf.device(placement.devices[t]), tf.name_scope(f"tower_{t}"):
            share = in_dtype(shares[t], tf.float64)  # a float64 model's digits
            return (x, y, sample_weight, tf.cast(firsts[t], tf.int32), share)

    def pass_of(model: keras.Model) -> Callable[..., Any]:
        return partial(_own_pass, model, work, shards.normaliser)

    trace = dict(jit=False, inline=inline, own=True)
    plans, calls = plans_for(placement, working, args_of, pass_of, **trace)
    devices = [placement.devices[t] for t in working]
    return run(plans, calls, devices, working, across)


def plans_for(
    placement: Placement,
    working: list[int],
    args_of: Callable[[int], tuple],
    pass_of: Callable[[Any], Callable[..., Any]],
    **trace: Any,
) -> tuple[list[Plan], list[tuple]]:
    """The one plan-per-shape loop: each working tower's ``args_of(t)``, and
    its model's pass traced and cut (``cut.trace``) once per model and shape."""
    plans: dict[tuple, Plan] = {}
    chosen, calls = [], []
    for t in working:
        model, args = placement.model_of(t), args_of(t)
        key = (id(model), xla.signature(args))
        if key not in plans:
            with tf.name_scope(f"tower_{t}"):
                plans[key] = cut.trace(pass_of(model), args, **trace)
        chosen.append(plans[key])
        calls.append(args)
    return chosen, calls


def _own_pass(model, work, examples, x, y, sample_weight, first, share) -> Any:
    """A tower's own step as traced to be cut: its seat's share, its rows."""
    seats.current().weight = share
    with places.rows_of((x, y, sample_weight), first, places.batch_rows()):
        return work(model, x, y, sample_weight, examples)


def tower_pass(
    builtin: BuiltIn,
    model: keras.Model,
    shards: Shards,
    divisors_of: Callable[[list], list[Any]],
    traced: list,
) -> Callable[..., tuple]:
    """A tower's pass as one function of ``(x, y, sample_weight, first, total,
    states, weights, scale)``: forward (its rows of the batch's draws), the
    step's divisors, loss share and gradients. Returns ``(TowerResult, its
    last states)``; ``traced`` collects the forward passes."""
    examples = shards.normaliser

    def run(x, y, sample_weight, first, total, states, weights, scale) -> tuple:
        recorded = builtin.forward(
            model, x, y, sample_weight, examples, states, weights, first, total
        )
        size = batch_size_of(x)
        divisors = [
            _step_divisor(term, d, size, examples)
            for term, d in zip(recorded.terms, divisors_of([recorded]))
        ]
        traced.append(recorded)
        return builtin.gradients(recorded, divisors, scale), recorded.states

    return run


def _value(plan: Plan, known: dict[str, Any], name: str) -> Any:
    """What the traced tensor ``name`` is in the run: a constant's value, or
    what an input, a sum or a phase made."""
    return plan.constants[name] if name in plan.constants else known[name]


def _handed(value: Any, plan: Plan, known: dict[str, Any]) -> Any:
    """What a tower hands an action in the run: ``value`` (as traced) with
    each tensor's value."""
    flat = tf.nest.flatten(value, expand_composites=True)
    run = [_value(plan, known, a.name) if cut.is_tensor(a) else a for a in flat]
    return tf.nest.pack_sequence_as(value, run, expand_composites=True)


def _sums(
    handed: list[tf.Tensor],
    devices: list[str],
    across: Callable[[tf.Tensor, bool], tf.Tensor] | None,
    backward: bool,
) -> list[tf.Tensor]:
    # The towers' sum on each tower's device (with across, tower 0's over the workers).
    sums = []
    for device in devices[: 1 if across else None]:
        with tf.device(device), tf.name_scope("towers_sum"):
            sums.append(seats.summed(handed, across, backward))
    return sums * (len(devices) if across else 1)


def _check_alike(plans: list[Plan]) -> None:
    def key(e: Any) -> tuple:
        if isinstance(e, Action):  # the same objects, tensors of one dtype
            flat = tf.nest.flatten(e.value, expand_composites=True)
            return e.phase, tuple(a.dtype if cut.is_tensor(a) else
                                  "form" if isinstance(a, Form) else id(a)
                                  for a in flat)  # fmt: skip
        return e.phase, e.backward, e.value.dtype

    first = [key(e) for e in plans[0].meetings]
    for plan in plans[1:]:
        other = [key(e) for e in plan.meetings]
        if other != first:
            raise seats.Unserved(
                "the towers' passes meet by sums (global batch statistics, a "
                f"divisor) {len(first)} and {len(other)} times, or at different "
                "phases, on shards of different shapes: the model's trace depends "
                "on its batch size"
            )


def _step_divisor(term: Any, divisor: Any, size: Any, examples: Any):
    # The step's divisor of term from this tower's: k * B when it is k per
    # example (integers: exact), none for a sum, else the towers' sum of theirs.
    if divisor is None:
        return None
    if term.kind == "mean" and isinstance(divisor, int) and isinstance(size, int):
        return divisor // size * examples if size else divisor  # empty: 0, as summed
    return seats.total(tf.cast(divisor, term.total.dtype))

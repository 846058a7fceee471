"""One tower's forward and backward passes, traced once and run on every tower.

Every tower of a shared model runs the same code on a shard of the same shape
(split sizes differ by at most one), so tracing each tower anew (the model's
whole forward and backward pass, T times) is work a user waits for before the
first step. Instead the tower's work is one ``tf.function``, traced once per
shard shape (at most two), and called under each tower's device: TensorFlow
inlines the calls into the step's graph, each call's ops on its tower's
device, the same graph a trace per tower builds.

A tower's loss divides by the whole step's divisor (``towers/step/tower.py``), which
one tower knows when it follows from the step's examples: ``D_o = k_o * B``
for Keras' default reductions, ``k_o`` being the tower's loss values per
example. When a divisor comes from sample weights or a mask, every tower's
pass is needed first, and :func:`compute` says so (None): the step then traces
tower by tower (``towers/step/runner.py``).

A layer that draws random numbers (Dropout in training) draws as one device
does (``towers/step/draws.py``): every tower's call starts from the seed
generators' states read once before the calls, draws its rows of the whole
batch's numbers (its first row is an argument of the call), and the first
tower's last states are assigned once after the calls. Assigned inside the
function instead, a state would order the calls (TensorFlow runs a call that
writes a variable after the call before it that also writes it).

With XLA (``Towers(jit_compile=True)``, ``towers/step/xla.py``) the same function
is compiled, so each tower's forward and backward pass is one XLA computation
on its device, and every tower takes this path: one function per model (a
copy per tower has its own). The weights are read before the call and passed
in. When a divisor needs every tower's forward pass, each tower's forward runs
first as one computation (for the divisors), then its forward again and its
backward as another, given them: the tape cannot reach from one computation
into the next, and the forward is the cheaper half to repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.split import Shards, batch_size_of
from towers.step import draws, xla
from towers.step.tower import Tower, TowerResult


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
    """The runner's ``"once"``: one trace for every tower of a model: each working
    tower's loss share and gradients, on its device. None if a divisor of the
    step needs every tower's forward pass; with XLA, that case too.

    ``divisors_of(passes)``: the step's divisors of ``passes`` (with its checks);
    given one tower's pass, that tower's own.
    """
    jit = tower.jit.enabled
    held = _Held(placement, working)

    def one_tower(model: Any) -> Callable[..., Any]:
        work = tower_pass(tower, model, shards, divisors_of, _step_divisor)
        return xla.function(work, jit, tower.inline)

    try:
        return held.run(working, shards, one_tower, _scale(tower))
    except _NeedsEveryTower:
        if not jit:
            return None
    return _forward_twice(placement, tower, shards, working, divisors_of)


def tower_pass(
    tower: Tower,
    model: Any,
    shards: Shards,
    divisors_of: Callable[[list], list[Any]],
    step_divisor: Callable[..., Any],
    traced: list | None = None,
) -> Callable[..., tuple]:
    """A tower's pass as one function of ``(x, y, sample_weight, first,
    states, weights, scale)``: its forward pass drawing its rows of the batch
    (``first``: its first row), its divisors (``step_divisor(term, divisor,
    size, examples)`` of each of ``divisors_of``'s for its own pass), its
    loss share and gradients. Returns ``(TowerResult, its last states)``;
    ``traced`` collects the forward passes."""
    examples = shards.normaliser

    def run(x, y, sample_weight, first, states, weights, scale) -> tuple:
        recorded = tower.forward(
            model, x, y, sample_weight, examples, states, weights, first
        )
        size = batch_size_of(x)
        divisors = [
            step_divisor(term, d, size, examples)
            for term, d in zip(recorded.terms, divisors_of([recorded]))
        ]
        if traced is not None:
            traced.append(recorded)
        return tower.gradients(recorded, divisors, scale), recorded.states

    return run


def _forward_twice(placement, tower, shards, working, divisors_of) -> list:
    """Each tower's forward pass as one XLA computation, the step's divisors of
    them all, then each tower's forward and backward as one more, given them."""
    examples = shards.normaliser

    def forward(model: Any) -> Callable[..., Any]:
        def forward_pass(x, y, sample_weight, first, states, weights, scale):
            del scale
            tower_pass = tower.forward(
                model, x, y, sample_weight, examples, states, weights, first
            )
            # The tape and the weights' values stay in the computation.
            tower_pass.tape, tower_pass.sources = None, []
            return tower_pass, tower_pass.states

        return xla.function(forward_pass, jit=True)

    held, scale = _Held(placement, working), _scale(tower)
    passes = held.run(working, shards, forward, scale, assign=False)
    divisors = divisors_of(passes)

    def both(model: Any) -> Callable[..., Any]:
        def forward_and_backward(
            x, y, sample_weight, first, states, weights, scale, divisors
        ) -> tuple:
            tower_pass = tower.forward(
                model, x, y, sample_weight, examples, states, weights, first
            )
            return tower.gradients(tower_pass, divisors, scale), tower_pass.states

        return xla.function(forward_and_backward, jit=True)

    # The same draws as the forward passes made: the same starts.
    return held.run(working, shards, both, scale, extra=(divisors,))


class _Held:
    """Each model's one function, called on every tower: every call starts
    from the step's seed states, the first tower's last states assigned once
    after the calls (the module's docstring, ``draws.Starts``)."""

    def __init__(self, placement: Any, working: list[int]):
        self.placement = placement
        self.starts = draws.Starts([placement.model_of(t) for t in working])

    def run(
        self, working, shards, make, scale: Any, extra: tuple = (), assign=True
    ) -> list:
        """Each working tower's call of ``make(model)`` (one function per
        model), in tower order; with ``assign``, the states assigned after the
        last. ``scale``: the loss scale, read outside an XLA computation (None:
        read in the call, and so are the weights)."""
        functions = {key: make(m) for key, m in self.starts.models.items()}
        firsts = draws.first_rows(shards)
        results = []
        for t in working:
            model = self.placement.model_of(t)
            x, y, sample_weight = shards.parts[t]
            with tf.device(self.placement.devices[t]), tf.name_scope(f"tower_{t}"):
                weights = None if scale is None else xla.read_weights(model)
                first = tf.cast(firsts[t], tf.int32)
                states = self.starts.of(model)
                args = (x, y, sample_weight, first, states, weights, scale)
                result, ended = functions[id(model)](*args, *extra)
            self.starts.ended(model, ended)
            results.append(result)
        if assign:
            self.starts.settle()
        return results


def _scale(tower: Tower) -> Any:
    """The loss scale, read before an XLA call (it lives on the variable
    device); None without XLA: the call reads it."""
    return tower.loss_scale() if tower.jit.enabled else None


def _step_divisor(term: Any, divisor: Any, size: int, examples: Any) -> Any:
    """The step's divisor of ``term`` from this tower's: ``k * B`` when it is
    ``k`` per example (exact: integers), none for a sum."""
    if divisor is None:
        return None
    if term.kind != "examples" or not isinstance(divisor, int):
        raise _NeedsEveryTower
    return divisor // size * examples

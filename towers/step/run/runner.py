"""How the towers run a step's work: decided once (:meth:`Runner.way`), from
what the work needs, and dispatched in one place (:meth:`Runner._run`).

- ``"alone"``: each tower traced in turn; nobody meets.
- ``"shared"``: one trace of the pass serves every tower (``phases.py``).
- ``"phases"``: the same, cut where the towers meet (``cut.py``).
- ``"turns"``: the towers traced side by side (``turns.py``), where a
  meeting gathers rows or runs code on one tower, or a pass cannot be cut."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import tensorflow as tf

from towers.cluster.workers import Workers
from towers.placement.base import Placement
from towers.split import Shards, split_for_towers
from towers.step.batches import HOST
from towers.step.rules import draws, places
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.run import phases, seats, turns, xla
from towers.step.work.builtin import BuiltIn, TowerResult
from towers.step.work.needs import OWN

Way = Literal["alone", "shared", "phases", "turns"]
# The way a step takes when its seats cannot serve a verb (seats.Unserved).
NEXT: dict[str, Way] = {"shared": "alone", "phases": "turns"}
# What a step runs: towers' own training pass (forward, divisors, backward),
# a pass without gradients (evaluation, prediction), a model's own step.
Kind = Literal["train", "evaluate", "predict", "own"]


@dataclasses.dataclass(eq=False)
class Runner:
    """Runs the working towers' work of a step, the way :meth:`way` says.

    Attributes:
      placement: where the variables live; each tower's device and model.
      builtin: the built-in pass (its needs: XLA, the coupled losses).
      moving_statistics: BatchNormalization's (whether the towers meet).
      workers: the other workers of a cluster, or None.
      learned: what the probe learned of the model's draws, across traces."""

    placement: Placement
    builtin: BuiltIn
    moving_statistics: MovingStatistics
    workers: Workers | None
    learned: places.Learned = dataclasses.field(default_factory=places.Learned)

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """The batch cut into the towers' shards ``(x_t, y_t, sw_t)``, on the
        host: every step's first phase."""
        with tf.device(HOST), tf.name_scope("split"):
            return split_for_towers((x, y, sample_weight), len(self.placement.devices))

    def meets(self, working: list[int]) -> bool:
        """Whether the working towers meet anyone: more than one, or a cluster."""
        return len(working) > 1 or self.workers is not None

    def across(self, kind: str) -> seats.Across | None:
        """The step's one handle on the other workers (None: no cluster)."""
        return None if self.workers is None else seats.Across(self.workers, kind)

    def way(self, kind: Kind, working: list[int], shards: Shards | None = None) -> Way:
        """How the working towers run a ``kind`` step, from what its work needs: a
        model's own step meets at its actions (phases where one trace serves
        every tower, else turns); a gathered loss in turns, without XLA; sums
        (global batch statistics, a mixture of experts' terms) or XLA in phases;
        else one trace shared where the towers share a model and shard sizes,
        else alone. A seat that cannot serve a verb sends the step to :data:`NEXT`."""
        needs = OWN if kind == "own" else self.builtin.needs(kind)
        meets = self.meets(working)
        if needs.actions:  # cut at its meetings where one trace serves all
            # In a cluster every worker cuts, one tower working or more: the
            # workers' collectives come in the cut's order (by phase) on each.
            alone = self.workers is not None and len(working) == 1
            shared = alone or phases.shareable(self.placement, shards, working)
            return "phases" if shared and shards.sizes is not None else "turns"
        if meets and needs.rows:
            return "turns"
        if (meets and needs.sums) or needs.xla:
            return "phases"
        shared = phases.shareable(self.placement, shards, working)
        return "shared" if shared else "alone"

    def train(
        self,
        shards: Shards,
        divisors_of: Callable[[list], list[Any]],
        weight_of: Callable[[list], Any],
    ) -> list[TowerResult]:
        """Every working tower's forward pass, the step's divisors
        (``divisors_of(passes)``), then every tower's loss share and gradients;
        ``weight_of(passes)``: this worker's weight in a cluster's sums."""
        working = self.placement.working_towers(shards)
        models = [self.placement.model_of(t) for t in working]
        with draws.drawing(self.workers, models, shards.size, "", self.learned):
            return self._train(shards, working, divisors_of, weight_of)

    def _train(self, shards, working, divisors_of, weight_of) -> list[TowerResult]:
        args = (self.placement, self.builtin, shards, working, divisors_of)

        def cut(meets: bool) -> list[TowerResult]:  # a new handle: numbered anew
            across = self.across("train")
            return phases.compute(*args, across, weight_of, meets)

        return self._run("train", working, shards, {
            "shared": partial(cut, False),
            "phases": partial(cut, True),
            "turns": lambda: in_turns(*args, self.across("train"), weight_of),
            "alone": lambda: in_halves(*args, _one_by_one),
        })  # fmt: skip

    def _run(self, kind: Kind, working, shards, ways: dict[Way, Callable]) -> list:
        """The one dispatcher: ``ways[way]()`` for the way :meth:`way` decides,
        the next way (:data:`NEXT`) where its seats cannot serve a verb."""
        way = self.way(kind, working, shards)
        while True:
            try:
                return ways[way]()
            except seats.Unserved as unserved:
                if way not in NEXT:
                    raise
                way = NEXT[way]
                if way == "turns" and kind == "train":
                    xla.refuse_uncut(self.builtin.jit, str(unserved))

    def each(
        self,
        shards: Shards,
        work: Callable[..., Any],
        kind: Kind,
        shares: tuple[Sequence[Any], Any] | None = None,
    ) -> list:
        """``work(model, x_t, y_t, sw_t, B)`` on each working tower (``predict``:
        ``work(model, x_t)``) the way it runs; ``shares`` (a model's own step):
        each tower's share and the workers' handle, for their seats."""
        working = self.placement.working_towers(shards)
        if kind == "predict":  # no copy need join a prediction without examples
            working = shards.working()

        def run(t: int) -> Callable[[], Any]:
            model = self.placement.model_of(t)
            x, y, sample_weight = shards.parts[t]
            if kind == "predict":
                return partial(on_tower, self.placement, t, partial(work, model, x))
            args = (model, x, y, sample_weight, shards.normaliser)
            if kind == "own":  # its states meet where it assigns them
                first = places.first_rows(shards)[t]
                rows = places.rows_of(shards.parts[t], first, places.batch_rows())
                return partial(on_tower, self.placement, t, partial(work, *args), rows)
            return partial(on_tower, self.placement, t, partial(work, *args))

        weights, across = shares or (None, self.across("eval"))

        def shared() -> list:  # one trace for every tower (training's: phases.py)
            model = self.placement.model_of(working[0])
            traced = xla.function(partial(work, model), False, self.builtin.inline)
            return _one_by_one(
                [_run_shared(self.placement, shards, traced, kind, t) for t in working]
            )

        def in_lockstep() -> list:
            meet = turns.meeting(len(working), self.placement, across)
            works = [run(t) for t in working]
            return turns.in_lockstep(works, meet, weights, shares is not None)

        return self._run(kind, working, shards, {
            "alone": lambda: _one_by_one([run(t) for t in working]),
            "shared": shared,
            "phases": lambda: phases.own(
                self.placement, shards, working, work, weights, across,
                self.builtin.inline,
            ),
            "turns": in_lockstep,
        })  # fmt: skip


def _one_by_one(works: list[Callable[[], Any]]) -> list:
    return [work() for work in works]


def _run_shared(placement, shards, work, kind: Kind, t: int) -> Callable[[], Any]:
    # Tower t's call of work, traced once for every tower of its shard shape.
    x, y, sample_weight = shards.parts[t]
    args = (x,) if kind == "predict" else (x, y, sample_weight, shards.normaliser)
    return partial(on_tower, placement, t, partial(work, *args))


def on_tower(placement: Placement, t: int, work: Callable[[], Any], within=None) -> Any:
    """``work()`` under tower ``t``'s device and name scope (and the context
    ``within``, if given)."""
    with tf.device(placement.devices[t]), tf.name_scope(f"tower_{t}"):
        with within or contextlib.nullcontext():
            return work()


def _forward(placement, builtin, shards, starts, t: int) -> Callable[[], Any]:
    """Tower ``t``'s forward pass in training mode, to run: from the step's
    seed states (``starts``), its draws its rows of the batch's."""
    x, y, sample_weight = shards.parts[t]
    model = placement.model_of(t)
    first, total = places.first_rows(shards)[t], places.batch_rows()

    def forward() -> Any:
        tower_pass = builtin.forward(
            model, x, y, sample_weight, shards.normaliser, starts.of(model),
            first=first, total=total,
        )  # fmt: skip
        starts.ended(model, tower_pass.states)
        return tower_pass

    return partial(on_tower, placement, t, forward)


def in_turns(
    placement,
    builtin,
    shards,
    working: list[int],
    divisors_of: Callable[[list], Any],
    across: seats.Across | None = None,
    weight_of: Callable[[list], Any] | None = None,
) -> list:
    """:meth:`Runner.train` in turns: the forward passes traced side by side,
    the divisors, then the backward passes; across workers each sum one
    collective, in one order everywhere, each worker weighted by
    ``weight_of(passes)`` (``seats.Across``)."""
    meet = turns.meeting(len(working), placement, across)

    def divided(passes: list) -> list[Any]:
        divisors = divisors_of(passes)
        if across is not None:
            across.weight = weight_of(passes)
        return divisors

    run = partial(turns.in_lockstep, meet=meet)
    return in_halves(placement, builtin, shards, working, divided, run)


def in_halves(
    placement,
    builtin,
    shards,
    working: list[int],
    divisors_of: Callable[[list], Any],
    run: Callable[[list], list],
) -> list[TowerResult]:
    """Every working tower's forward pass (from the step's seed states), the
    divisors of them all, then every tower's loss share and gradients;
    ``run(works)`` runs each half: one by one, or in turns."""
    starts = draws.Starts([placement.model_of(t) for t in working])
    forward = partial(_forward, placement, builtin, shards, starts)
    passes = run([forward(t) for t in working])
    starts.settle()
    divisors = divisors_of(passes)
    return run(
        [
            partial(on_tower, placement, t, partial(builtin.gradients, p, divisors))
            for t, p in zip(working, passes)
        ]
    )

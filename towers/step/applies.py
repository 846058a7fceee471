"""Each apply of a model's own step: the towers meet, combine, apply once.

Every ``optimizer.apply`` (or ``apply_gradients``) a tower's own
``train_step`` makes is routed here (``towers/_keras``'s
``routed_applies``). Each tower hands in its gradients and its weight: its
share of the examples, ``n_t / B``, for the gradient of a mean over its
rows; 1 for the gradient of a sum over them. ``tape.gradient`` is routed
here too, to tell which: a target with a value per row (a first axis of
the shard's rows, as ``keras.losses.mean_squared_error(y, y_pred)``
returns) is summed by the tape, and so is a scalar loss with
``own_step_loss="sum"``; any other scalar is a mean. The first tower
combines them (``combine_gradients``, weighted, summed), sums them over the
workers in a cluster (each weighted by its share of the global batch), and
applies once, on the variable device; the others apply nothing and read the
new values after. With a copy per tower (``towers/placement/replicas.py``),
every tower applies to its own copy: the all-reduced weighted gradients
(replicated) or its own (independent).

The engine's policies act per apply, as the step makes them:

- ``on_nonfinite="skip"``: an apply whose combined gradient has an inf or
  NaN is skipped (nothing of it applied, the optimizer's iterations kept);
  the step goes on. ``"raise"``: the same, then the engine raises after the
  step, naming the variable; so that nothing is half-applied, a step that
  applies more than once or assigns a variable is refused with ``"raise"``
  by name, when traced, before any update.
- ``accumulate_steps=k``: each optimizer the step applies with accumulates
  as Keras' own ``gradient_accumulation_steps=k`` does (set before it is
  built, at its first apply): every apply adds the combined gradient, every
  k-th applies their mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.combine import combine_gradients
from towers.placement.update import finite_flags
from towers.step import draws
from towers.step.meetings import own_step_seat, seated

# Instance keys of one apply's all-reduce: each apply of a step takes its own
# range (the shapes differ from apply to apply).
INSTANCES_PER_APPLY = 1000


class Applies:
    """The applies of a model's own step, met by the towers.

    Args:
      placement: where the variables live; combines (its reducer) and, with
        a copy per tower, all-reduces.
      on_nonfinite: ``"ignore"``, ``"skip"`` or ``"raise"``.
      accumulate_steps: Keras' ``gradient_accumulation_steps`` for each
        optimizer the step applies with (1: none).

    Attributes:
      names: the optimizers met at, in order, while a step is traced.
      checked: per checked apply, its flags (one per gradient) and variables.
    """

    def __init__(self, placement: Any, on_nonfinite: str, accumulate_steps: int):
        self.placement = placement
        self.on_nonfinite = on_nonfinite
        self.accumulate_steps = accumulate_steps
        self.names: list[str] = []
        self.checked: list[tuple[tf.Tensor, list[Any]]] = []
        self.over_workers: Callable[[tf.Tensor, bool], tf.Tensor] | None = None
        # Per tower, while a step is traced: whether each gradient it took
        # (by id, kept alive) was of a sum.
        self._sums: dict[int, dict[int, tuple[Any, bool]]] = {}

    def begin(self, over_workers: Callable[[tf.Tensor, bool], tf.Tensor] | None):
        """A step is traced: ``over_workers(value, summed)``, a value weighted
        by this worker's weight (in a gradient of a sum, 1) and summed over
        the workers (None: no cluster)."""
        self.names, self.checked, self.over_workers = [], [], over_workers
        self._sums = {}

    def gradient(self, target: Any, gradient: Callable[[Any], Any]) -> Any:
        """``tape.gradient(target, ...)`` inside a tower's step (``gradient``:
        the tape's own): taken, each gradient remembered as one of a sum over
        the tower's rows or of a mean (the module docstring)."""
        here = own_step_seat()
        if here is None:
            return gradient(target)
        summed = here.loss == "sum" or _per_row(target, draws.shard_size())
        before, here.summing = here.summing, summed  # what a backward sum reads
        try:
            grads = gradient(target)
        finally:
            here.summing = before
        for g in tf.nest.flatten(grads):
            if g is not None:
                self._sums.setdefault(here.rank, {})[id(g)] = (g, summed)
        return grads

    def _summed(self, rank: int, grads: Any) -> bool:
        """Whether ``grads`` are of a sum over tower ``rank``'s rows: as its
        tape took them, or, for values the step made of them, as every
        gradient it took."""
        taken = self._sums.get(rank, {})
        grads = [g for g in tf.nest.flatten(grads) if g is not None]
        kinds = {taken[id(g)][1] for g in grads if id(g) in taken}
        if not kinds or any(id(g) not in taken for g in grads):
            kinds |= {summed for _, summed in taken.values()}
        if len(kinds) > 1:
            raise ValueError(
                "a train_step on towers applied gradients of a sum over its "
                "rows (a loss with a value per example) and of a mean (a "
                "scalar loss) together, or gradients it made of both: the "
                "towers cannot tell how to weigh them. Reduce every loss the "
                "same way before tape.gradient (keras.ops.mean). Nothing was "
                "updated."
            )
        return kinds.pop() if kinds else False

    def finite(self) -> tuple[tf.Tensor, list[Any]] | None:
        """The step's flags, every checked apply's in order, and their
        variables; None when no apply was checked."""
        if not self.checked:
            return None
        flags = tf.concat([flags for flags, _ in self.checked], 0)
        return flags, [v for _, variables in self.checked for v in variables]

    def refuse_raise(self, assigned: list[str]) -> None:
        """With ``on_nonfinite="raise"``, refuses a step that applies more
        than once or assigns a variable (``assigned``: their paths): a raise
        after it would leave it half-applied."""
        if self.on_nonfinite != "raise" or (len(self.names) <= 1 and not assigned):
            return
        what = f"applies {len(self.names)} times ({', '.join(self.names)})"
        if assigned:
            what = f"assigns {', '.join(assigned)}"
        raise ValueError(
            f"on_nonfinite='raise' stops a step before anything of it is "
            f"applied; received a train_step that {what}, which would be "
            "left half-applied. Use on_nonfinite='skip' (each apply skipped "
            "alone) or 'ignore'. Nothing was updated."
        )

    def meet(self, optimizer: Any, grads: Any, variables: Any, apply: Any) -> Any:
        """An ``optimizer.apply(grads, variables)`` inside a tower's step
        (``apply``: the optimizer's own): met, combined, applied once."""
        here = own_step_seat()
        if here is None:  # not a tower's step, or the apply itself
            return apply(grads, variables)
        # None: the variables the optimizer was built with (Keras' rule).
        variables = None if variables is None else list(variables)
        summed = here.loss == "sum" or self._summed(here.rank, grads)
        weight = 1.0 if summed else here.weight
        handed = here.everyone((optimizer, variables or [], grads, weight, summed))
        copies = len(self.placement.models) > 1
        check_same(handed, copies)
        if here.first:
            self.names.append(optimizer.name)
        elif not copies:
            return None
        with seated(None):  # the optimizer's own apply may call apply again
            if copies:  # each tower applies to its own copy
                return self._apply_each(here, handed, apply)
            # Out of tower 0's scope ("x/" names a scope from the top).
            with tf.device(self.placement.variable_device):
                with tf.name_scope("combine/"):
                    combined = combine_gradients(
                        [grads for _, _, grads, *_ in handed],
                        weights=[share for *_, share, _ in handed],
                        reduction="sum",
                        reducer=self.placement.reducer,
                    )
                if self.over_workers is not None:
                    with tf.name_scope("across_workers/"):
                        combined = [
                            None if g is None else self.over_workers(g, summed)
                            for g in combined
                        ]
                with tf.name_scope("apply/"):
                    return self._apply(optimizer, combined, variables, apply)

    def _apply(self, optimizer: Any, grads: list, variables: Any, apply: Any) -> Any:
        """``apply(grads, variables)`` by the policies (the module docstring)."""
        if self.accumulate_steps > 1:
            _accumulating(optimizer, self.accumulate_steps)
        if self.on_nonfinite == "ignore":
            return apply(grads, variables)
        if not optimizer.built:  # as its apply would, outside the condition
            optimizer.build(variables)
        pairs = [(g, i) for i, g in enumerate(grads) if g is not None]
        flags = finite_flags([g for g, _ in pairs])
        named = variables or [f"gradient {i} of {optimizer.name}" for _, i in pairs]
        self.checked.append((flags, [named[i] for _, i in pairs]))

        def update() -> None:
            apply(grads, variables)

        tf.cond(tf.reduce_all(flags), update, lambda: None)
        return None

    def _apply_each(self, seat: Any, handed: list, apply: Any) -> Any:
        """The apply of ``seat``'s tower to its copy's variables (what it
        handed in, with every tower's ``handed``)."""
        rank = seat.rank
        _, variables, grads, *_ = handed[rank]
        if self.placement.name == "replicated":
            sums = seat.from_first(lambda: self._all_reduced(handed))
            grads = sums[rank]
        with tf.device(self.placement.devices[rank]), tf.name_scope("apply/"):
            return apply(grads, variables)

    def _all_reduced(self, handed: list) -> list[list]:
        """Every tower's gradients weighted by its share and all-reduced by
        the placement (``Replicated.combine``): per tower, the sums (None
        where no tower has a gradient)."""
        weighted = []
        for t, (_, _, grads, share, _) in enumerate(handed):
            with tf.device(self.placement.devices[t]):
                weighted.append(
                    combine_gradients([list(grads)], weights=[share], reduction="sum")
                )
        variables = [variables for _, variables, *_ in handed]
        first = (len(self.names) - 1) * INSTANCES_PER_APPLY
        with tf.name_scope("all_reduce/"):
            return self.placement.combine(weighted, variables, first)


def check_same(handed: list[tuple], copies: bool = False) -> None:
    """Refuses towers that met at different applies (another optimizer, or
    other variables; with a copy per tower, another kind or shapes), naming
    the two; or towers whose gradients were of a sum on one, of a mean on
    another."""
    optimizer, variables, *_, summed = handed[0]
    for other, (theirs, their_variables, *_, sums) in enumerate(handed[1:], 1):
        if sums != summed:
            raise ValueError(
                f"the towers' train_step took its gradients of a "
                f"{'sum' if summed else 'mean'} over tower 0's rows and of a "
                f"{'sum' if sums else 'mean'} over tower {other}'s: a loss "
                "with a first axis as long as a tower's rows is read as a "
                "value per example. Reduce the loss to a scalar "
                "(keras.ops.mean) before tape.gradient; nothing was updated."
            )
        key = (lambda v: v.shape) if copies else id
        same = [key(v) for v in their_variables] == [key(v) for v in variables]
        same = same and (
            type(theirs) is type(optimizer) if copies else theirs is optimizer
        )
        if not same:
            raise ValueError(
                "the towers' train_step reached different applies: tower 0 "
                f"applied {optimizer.name} to {len(variables)} variables, tower "
                f"{other} {theirs.name} to {len(their_variables)}. A step must "
                "make the same applies on every shard; nothing was updated."
            )


def _per_row(target: Any, rows: Any) -> bool:
    """Whether ``target`` (``tape.gradient``'s) has a value per row of a
    shard of ``rows`` (a first axis that long, or unknown with it), which the
    tape sums; else it is read as a mean (a scalar, or a vector of means).

    >>> _per_row(tf.zeros([4]), tf.TensorShape([4])[0]), _per_row(tf.zeros([]), 4)
    (True, False)
    """
    shapes = [tf.TensorShape(t.shape) for t in tf.nest.flatten(target)]
    rows = tf.compat.dimension_value(rows)
    return any(s.rank and s[0] in (rows, None) for s in shapes)


def _accumulating(optimizer: Any, steps: int) -> None:
    """Gives ``optimizer`` Keras' ``gradient_accumulation_steps=steps`` before
    it is built (its accumulators are made then).

    Raises:
      ValueError: it was built already, or accumulates by another count.
    """
    own = optimizer.gradient_accumulation_steps
    if own == steps:
        return
    if optimizer.built or own is not None:
        why = "was built already" if own is None else f"accumulates {own} steps"
        raise ValueError(
            f"accumulate_steps={steps} with a model's own train_step gives each "
            "optimizer it applies with Keras' gradient_accumulation_steps, "
            f"before it is built; received {optimizer.name}, which {why}. Pass "
            "gradient_accumulation_steps to the optimizer instead."
        )
    optimizer.gradient_accumulation_steps = steps

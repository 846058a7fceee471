"""Each apply of a model's own step: the towers meet, combine, apply once.

Every ``optimizer.apply`` and ``tape.gradient`` a tower's step makes is
routed here. A gradient is handed back as a mean's over the tower's rows
(``loss_kinds.py``); at an apply each tower hands in its gradients weighted
by its share ``n_t / B`` and the step's tail applies them once
(``tail.Tail.apply_met``), by an ``Update`` per optimizer: ``on_nonfinite``
per apply and ``accumulate_steps``. With a copy per tower each applies to
its own, all-reduced (replicated) or alone (independent)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras.optimizers import Optimizer

from towers._keras.current import Seat
from towers._keras.optimizers import optimizer_variables
from towers.combine import combine_gradients, in_dtype
from towers.placement.base import Placement
from towers.placement.update import Update
from towers.step.rules import float8, loss_kinds
from towers.step.run.seats import Across, current, seated
from towers.step.tail import Tail

# Instance keys of one apply's all-reduce: each apply of a step takes its own
# range (the shapes differ from apply to apply).
INSTANCES_PER_APPLY = 1000


class Applies:
    """The applies of a model's own step, met by the towers.

    Args:
      placement: where the variables live (with copies, their all-reduce).
      update: the engine's (its ``on_nonfinite``, its steps counter).
      accumulate_steps: the engine's, for each optimizer's update.
      tail: the step's, run at each apply.

    Attributes:
      names: the optimizers met at, in order, while a step is traced.
      checked: per checked apply, its flags and variables.
      saved: what checkpoints save: each update's accumulator."""

    def __init__(
        self, placement: Placement, update: Update, accumulate_steps: int, tail: Tail
    ):
        self.placement = placement
        self.tail = tail
        self.engine_update = update
        self.on_nonfinite = update.on_nonfinite
        self.accumulate_steps = accumulate_steps
        self.updates: dict[int, Update] = {}  # by optimizer, at its first apply
        self.saved = tf.Module(name="own_step_updates")
        self.saved.accumulators = []
        # The step's (global) examples and this worker's, while traced.
        self.examples: Any = None
        self.mine: Any = None
        # The kinds of the step's losses, in call order (probe.probe).
        self.kinds: list[loss_kinds.Kind] | None = None
        self.whole_batch = False  # every loss the whole batch's (gathered)
        self.unprobed = False  # the probe could not run: means, then checked
        self.begin(None, [])

    def begin(self, across: Across | None, batch: list[tf.Tensor]):
        """A step is traced: ``across`` (None: no cluster) and its input tensors."""
        self.names, self.checked, self.across = [], [], across
        self.batch, self.means, self._calls = batch, {}, {}
        self.losses: dict[Any, loss_kinds.Kind] = {}  # by ref: the kind found

    def gradient(self, target: Any, sources: Any, gradient: Callable) -> Any:
        """``tape.gradient`` in a tower's step (``gradient``: the tape's own),
        handed back as the gradient of a mean over the tower's rows."""
        here = current()
        if not here.own:
            return gradient(target)
        kind = self._kind(here)
        if isinstance(target, tf.Tensor) and target.shape.rank == 0:
            self.losses[target.ref()] = kind
        before, here.summing = here.summing, kind != "mean"  # a backward sum's
        try:
            grads = gradient(target)
        finally:
            here.summing = before
        flat, sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        # A gradient with respect to a tensor (WGAN-GP's, of the outputs with
        # respect to the inputs) is the examples' own: it meets at no apply.
        weights = [isinstance(v, (tf.Variable, keras.Variable)) for v in sources]
        if kind == "mean" or not any(weights):
            return grads
        share = here.weight if self.across is None else here.weight * self.across.weight
        free = None
        if tf.convert_to_tensor(target).shape.rank == 0:
            target = tf.convert_to_tensor(target)
            if kind == "sum":  # its batch-free terms set apart
                free = loss_kinds.batch_free(target, here.inputs or self.batch)
            [self.means[target.ref()]] = loss_kinds.as_mean([target], [free], share)
        free_grads = [None] * len(flat)
        if free is not None:
            free_grads = tf.gradients(free, sources)
        means = loss_kinds.as_mean(flat, free_grads, share)
        flat = [m if weight else g for m, g, weight in zip(means, flat, weights)]
        return tf.nest.pack_sequence_as(grads, flat)

    def _kind(self, here: Any) -> loss_kinds.Kind:
        """The kind of the tower's next loss, as the probe found it by its
        place in the tower's calls."""
        place = self._calls.get(here, 0)  # by seat: a tower, a trace
        self._calls[here] = place + 1
        if self.whole_batch or self.unprobed:
            return "mean"
        if self.kinds is not None and place < len(self.kinds):
            return self.kinds[place]
        if self.kinds is None and here.weight == 1 and self.across is None:
            return "mean"  # one tower alone: its loss is the batch's
        raise ValueError(
            f"a train_step on towers took tape.gradient of a loss number "
            f"{place + 1} in one step, where the probe on the first batch of "
            f"two or more examples found {len(self.kinds or [])}: how it "
            "depends on the batch is not known. A step must take the same "
            "gradients on every batch. Nothing was updated."
        )

    def loss_kind(self, value: Any) -> loss_kinds.Kind | None:
        """The kind of the loss ``value`` is (one the step took the gradient
        of, through casts), or None."""
        while isinstance(value, tf.Tensor) and value.op.type in ("Cast", "Identity"):
            if value.ref() in self.losses:
                break
            value = value.op.inputs[0]
        return self.losses.get(value.ref()) if isinstance(value, tf.Tensor) else None

    def as_mean(self, value: Any) -> Any:
        """``value`` as a mean over the tower's rows, where it is a sum's loss
        the step took the gradient of (:meth:`gradient`); else itself."""
        if not isinstance(value, tf.Tensor):
            return value
        return self.means.get(value.ref(), value)

    def finite(self) -> tuple[tf.Tensor, list[Any]] | None:
        """The step's flags, every checked apply's in order, and their
        variables; None when no apply was checked."""
        if not self.checked:
            return None
        flags = tf.concat([flags for flags, _ in self.checked], 0)
        return flags, [v for _, variables in self.checked for v in variables]

    def refuse_raise(self, assigned: list[str]) -> None:
        """With ``on_nonfinite="raise"``, refuses a step that applies more than
        once or assigns a variable: a raise after it would leave it half-applied."""
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

    def meet(self, optimizer: Optimizer, grads: Any, variables: Any, apply: Any) -> Any:
        """An ``optimizer.apply(grads, variables)`` inside a tower's step
        (``apply``: the optimizer's own): met, combined, applied once."""
        here = current()
        if not here.own:  # not a tower's step, or the apply itself
            return apply(grads, variables)
        # None: the variables the optimizer was built with (Keras' rule).
        variables = None if variables is None else list(variables)
        if len(self.placement.models) > 1:  # each tower applies to its own copy
            handed = here.everyone((optimizer, variables or [], grads, here.weight))
            check_same(handed, True)
            if here.first:
                self.names.append(optimizer.name)
            with seated(None):  # the optimizer's own apply may call apply again
                return self._apply_each(here, handed, apply)

        listed = variables or optimizer_variables(optimizer)
        # Weighed on the tower's device, as the built-in step's gradients are
        # (in a cut pass, traced once for every tower).
        handed = (optimizer, variables or [], _weighted(grads, listed, here.weight))

        def once(handed: list) -> None:
            check_same(handed)
            self.names.append(optimizer.name)
            weighted = [grads for _, _, grads in handed]
            if all(g is None for grads in weighted for g in grads):
                return apply(handed[0][2], listed)  # Keras' own refusal
            if not optimizer.built:  # on every variable given, as its apply would
                optimizer.build(listed)
            update = self._update_of(optimizer, listed)
            first = (len(self.names) - 1) * INSTANCES_PER_APPLY
            flags = self.tail.apply_met(
                update, weighted, listed, self.batch, self.examples, self.mine, first
            )
            if flags is not None:
                self.checked.append((flags, list(update.applied)))

        return here.once(handed, once)

    def _update_of(self, optimizer: Optimizer, variables: list) -> Update:
        """``optimizer``'s update, made at its first apply (out of the trace:
        its accumulators are saved with checkpoints, ``saved``)."""
        update = self.updates.get(id(optimizer))
        if update is None:
            own = optimizer.gradient_accumulation_steps
            if self.accumulate_steps > 1 and own not in (None, 1):
                raise ValueError(
                    f"accumulate_steps={self.accumulate_steps} accumulates a "
                    "model's own train_step's applies in towers; received "
                    f"{optimizer.name}, which accumulates {own} steps itself. "
                    "Pass one of them. Nothing was updated."
                )
            with tf.init_scope():
                engine = self.engine_update
                update = Update(
                    optimizer, engine.device, self.on_nonfinite, self.accumulate_steps
                )
                update.steps = engine.steps  # the engine counts the steps
                update.build(variables)
            if update.accumulator is not None:
                self.saved.accumulators.append(update.accumulator)
            self.updates[id(optimizer)] = update
        return update

    def flush(self) -> None:
        """Applies every partly filled accumulation window (``Update.flush``)."""
        for update in self.updates.values():
            update.flush()

    def _apply_each(self, seat: Seat, handed: list, apply: Any) -> Any:
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
        # Each tower's gradients by its share, all-reduced (None: no tower has one).
        weighted = []
        for t, (_, _, grads, share) in enumerate(handed):
            with tf.device(self.placement.devices[t]):
                weighted.append(
                    combine_gradients([list(grads)], weights=[share], reduction="sum")
                )
        variables = [variables for _, variables, *_ in handed]
        first = (len(self.names) - 1) * INSTANCES_PER_APPLY
        with tf.name_scope("all_reduce/"):
            return self.placement.combine(weighted, variables, first)


def check_same(handed: list[tuple], copies: bool = False) -> None:
    """Refuses towers that met at different applies, naming the two."""
    optimizer, variables, *_ = handed[0]
    for other, (theirs, their_variables, *_) in enumerate(handed[1:], 1):
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


def _weighted(grads: list, variables: list, share: Any) -> list:
    """A tower's gradients times its share of the batch, as the built-in
    step's are; a value in place of a gradient as it is (``float8.py``)."""

    shares: dict[tf.DType, tf.Tensor] = {}  # one cast a dtype

    def times_share(value: tf.Tensor) -> tf.Tensor:
        if value.dtype not in shares:
            shares[value.dtype] = in_dtype(share, value.dtype)
        return value * shares[value.dtype]

    def scaled(grad: Any, variable: Any) -> Any:
        if grad is None or float8.is_value(variable):
            return grad
        if isinstance(grad, tf.IndexedSlices):
            values = times_share(grad.values)
            return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
        return times_share(grad)

    return [scaled(g, v) for g, v in zip(grads, variables)]

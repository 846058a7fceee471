"""The built-in pass of one tower: its forward pass, its share of the loss,
and its gradients, the same code on every device.

Its loss divides by the whole step's divisor, which needs every tower's
shard, so the work has two halves::

    forward:    y_pred = model(x_t)                 under a GradientTape
                S_to, D_to per output               (losses.py)
                extra_t = model.losses * n_t / B    (regularisers, add_loss)
    gradients:  D_o = sum_t D_to                    (the step's)
                loss_t  = sum_o w_o S_to / D_o + extra_t
                grads_t = the tape's gradient of [S_to..., extra_t] with
                          upstream [w_o / D_o..., 1]

The divisors do not depend on the variables, so the towers' losses and
gradients add up to the whole batch's."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras import (
    ReadScope,
    call_model,
    compute_loss,
)
from towers.split import batch_size_of
from towers.step.rules import places
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.rules.coupled import CoupledLosses
from towers.step.rules.forms import form_of
from towers.step.rules.state import state_variables
from towers.step.rules.whole_batch import gathered_loss
from towers.step.run import xla
from towers.step.work.losses import StepLoss, Term, over
from towers.step.work.needs import Needs


@dataclasses.dataclass
class TowerPass:
    """A tower's forward pass, recorded for its gradients: per output with a
    loss its ``terms``; ``extra``, the model's own losses (or its
    ``compute_loss``) weighted by the tower's share; ``sources``, each
    variable's value as the tower read it; ``states``, the seed states after
    the pass; ``state``, ``state_values`` and ``state_forms``, the other
    variables it assigned, their values and forms (``forms.form_of``)."""

    terms: list[Term]
    extra: tf.Tensor | None
    predictions: Any
    variables: list[Any]
    sources: list[tf.Tensor] = dataclasses.field(default_factory=list)
    tape: tf.GradientTape | None = None
    moments: dict[int, tuple] = dataclasses.field(default_factory=dict)
    states: list[tf.Tensor] = dataclasses.field(default_factory=list)
    state: list[Any] = dataclasses.field(default_factory=list)
    state_values: list[tf.Tensor] = dataclasses.field(default_factory=list)
    state_forms: list[Any] = dataclasses.field(default_factory=list)

    def keep_state(self, scope: ReadScope, batch: Any) -> TowerPass:
        """Takes the variables ``scope`` saw assigned, their values and forms."""
        self.state = list(scope.assigned.values())
        self.state_values = [scope.get_current_value(v) for v in self.state]
        self.state_forms = [form_of(value, batch) for value in self.state_values]
        return self

    def output_losses(self, divisors: list[Any]) -> dict[str, tf.Tensor]:
        """Per output (of several), the tower's share of its unweighted loss."""
        if len(self.terms) < 2:
            return {}
        return {t.name: over(t.total, d) for t, d in zip(self.terms, divisors)}

    def loss(self, divisors: list[Any]) -> tf.Tensor:
        """The tower's share of the step's loss, given the step's divisors."""
        shares = [_weighted(t, over(t.total, d)) for t, d in zip(self.terms, divisors)]
        if self.extra is not None:
            shares.append(self.extra)
        return tf.add_n(shares) if shares else tf.constant(0.0)


@dataclasses.dataclass
class TowerResult(TowerPass):
    """What one tower hands back: its pass (its tape and sources dropped),
    its share of the step's loss (unscaled) and its gradients (of ``scale *
    loss`` under loss scaling: the update unscales their combination once;
    None where no path leads from the loss)."""

    loss: Any = None
    grads: list[Any] = dataclasses.field(default_factory=list)
    output_losses: dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)


class BuiltIn:
    """The built-in pass of one tower, and what it needs of the runner.

    Args:
      loss_scale: the current loss scale (a zero-arg function).
      own_loss: the model overrides Keras' ``compute_loss``: each tower calls
        it on its shard, weighted by its share ``n_t / B``.
      jit: each pass one XLA computation.
      coupled: the loss terms that couple the batch's examples (``coupled.py``).

    Example:
      >>> import keras, numpy as np
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> work = BuiltIn(StepLoss("mse"), MovingStatistics(lambda: model), lambda: 1.0)
      >>> x, y = np.zeros((3, 2), "float32"), np.ones((3, 1), "float32")
      >>> tower_pass = work.forward(model, x, y, None, examples=6)  # 3 of 6
      >>> result = work.gradients(tower_pass, divisors=[6])
      >>> float(result.loss), len(result.grads)  # errors of 1: 3 * 1 / 6
      (0.5, 2)
    """

    def __init__(
        self,
        loss: StepLoss,
        moving_statistics: MovingStatistics,
        loss_scale: Callable[[], Any],
        own_loss: bool = False,
        jit: xla.Jit = xla.OFF,
        coupled: CoupledLosses | None = None,
    ):
        self.loss = loss
        self.moving_statistics = moving_statistics
        self.loss_scale = loss_scale
        self.own_loss = own_loss
        self.jit = jit
        self.coupled = coupled or CoupledLosses(None, towers=1)
        self.inline = True  # the towers' traced passes inlined (phases.py)

    def needs(self, kind: str) -> Needs:
        """What this pass needs of the towers' way for a ``kind`` step."""
        if kind != "train":
            return Needs(rows=self.coupled.gathered and kind == "evaluate")
        sums = self.moving_statistics.meets or self.coupled.exact
        return Needs(rows=self.coupled.gathered, sums=sums, xla=self.jit.enabled)

    def forward(
        self,
        model: keras.Model,
        x: Any,
        y: Any,
        sample_weight: Any,
        examples: Any,
        states: list[tf.Tensor] | None = None,
        weights: list[tf.Tensor] | None = None,
        first: Any = None,
        total: Any = None,
    ) -> TowerPass:
        """The forward pass in training mode, recorded for :meth:`gradients`:
        ``examples`` is B; ``states``, the seed states to start from (None:
        assigned as drawn); ``weights``, the weights read outside an XLA
        computation (None: read here); ``first``, the shard's first row of
        ``total``, so its draws are its rows of the batch's (``places.py``)."""
        variables = list(model.trainable_variables)  # read at trace: the set now
        tape = tf.GradientTape()
        size = places.size_of(x)
        placed = None if first is None else places.rows(size, first, total)
        with (
            placed or contextlib.nullcontext(),
            weights_here(model, states, weights) as scope,
        ):
            sources = [scope.get_current_value(v) for v in variables]
            with (
                tape,
                self.moving_statistics.recording() as moments,
                self.coupled.computing(),
            ):
                tape.watch(sources)
                tower_pass = self._pass(
                    model, x, y, sample_weight, examples, True, scope
                )
            if states is not None:
                tower_pass.states = [
                    scope.get_current_value(v) for v in state_variables(model)
                ]
            tower_pass.keep_state(scope, (x, y, sample_weight, first, total))
        tower_pass.tape, tower_pass.moments = tape, moments
        tower_pass.variables, tower_pass.sources = variables, sources
        return tower_pass

    def gradients(
        self, tower_pass: TowerPass, divisors: list[Any], scale: Any = None
    ) -> TowerResult:
        """The tower's loss share and gradients, given the step's divisors."""
        scale = self.loss_scale() if scale is None else scale
        # Each upstream in its target's dtype: a float64 model stays float64.
        targets = [t.total for t in tower_pass.terms]
        upstream = [
            over(tf.cast(scale, t.total.dtype) * t.weight, d)
            for t, d in zip(tower_pass.terms, divisors)
        ]
        if tower_pass.extra is not None:
            targets.append(tower_pass.extra)
            upstream.append(tf.cast(scale, tower_pass.extra.dtype))
        grads = tower_pass.tape.gradient(
            targets, tower_pass.sources, output_gradients=upstream
        )
        # What crosses a cut: the pass without its tape.
        kept = {**vars(tower_pass), "sources": [], "tape": None, "states": []}
        loss, outputs = tower_pass.loss(divisors), tower_pass.output_losses(divisors)
        return TowerResult(**kept, loss=loss, grads=grads, output_losses=outputs)

    def evaluate(
        self, model: keras.Model, x: Any, y: Any, sample_weight: Any, examples: Any
    ) -> TowerPass:
        """The tower's predictions and loss terms, in inference mode."""

        def evaluate(x: Any, y: Any, sample_weight: Any, weights: Any) -> TowerPass:
            with weights_here(model, weights=weights) as scope:
                tower_pass = self._pass(
                    model, x, y, sample_weight, examples, False, scope
                )
                return tower_pass.keep_state(scope, (x, y, sample_weight))

        return self._run(model, evaluate, x, y, sample_weight)

    def predict(self, model: keras.Model, x: Any) -> TowerPass:
        """The model's outputs on the shard in inference mode, what it assigned."""

        def predict(x: Any, weights: Any) -> TowerPass:
            with weights_here(model, weights=weights) as scope:
                outputs = call_model(model, x, False)
                return TowerPass([], None, outputs, []).keep_state(scope, x)

        return self._run(model, predict, x)

    def _run(self, model: keras.Model, work: Callable[..., Any], *args: Any) -> Any:
        # work(*args, weights): one XLA computation, its weights read here; or inline.
        if not self.jit.enabled:
            return work(*args, None)
        return xla.function(work, jit=True)(*args, xla.read_weights(model))

    def _pass(
        self, model, x, y, sample_weight, examples, training: bool, scope=None
    ) -> TowerPass:
        y_pred = call_model(model, x, training)
        terms, extra = [], None
        if self.own_loss and self.coupled.gathered:
            # The whole batch's loss, this tower's term of it (whole_batch.py).
            share = _share(x, examples, tf.float64)
            batch = (x, y, y_pred, sample_weight)
            extra = gathered_loss(model, batch, share, scope, training)
            return TowerPass([], extra, y_pred, list(model.trainable_variables))
        if self.own_loss:
            extra = compute_loss(model, x, y, y_pred, sample_weight, training)
        else:
            terms = self.loss.terms(y, y_pred, sample_weight)
            extra = tf.add_n(model.losses) if model.losses else None
        if extra is not None:
            # The model's own losses are per-batch means in Keras 3 (and so is
            # Keras' compute_loss): weight by n_t / B so the towers' shares add
            # up to the full batch's. A term that sums over the examples
            # (found by the probe) adds up as it is.
            share = _share(x, examples, extra.dtype)
            sums = self.coupled.summed_terms(model)
            extra = extra * share
            if sums is not None and not self.own_loss:
                extra += tf.cast(sums, extra.dtype) * (1 - share)
        return TowerPass(terms, extra, y_pred, list(model.trainable_variables))


@contextlib.contextmanager
def weights_here(
    model: keras.Model,
    states: list[tf.Tensor] | None = None,
    weights: list[tf.Tensor] | None = None,
) -> Iterator[ReadScope]:
    """Within, each of ``model``'s weights reads as one tensor read once on the
    tower's device (an XLA computation reads no other device's variable);
    with ``states``, the seed generators read as them, their assignments kept
    in the scope (yielded)."""
    values = xla.read_weights(model) if weights is None else weights
    mapping = list(zip(model.weights, values))
    seeds = state_variables(model)
    held = seeds if states is not None else []
    mapping += list(zip(held, states or []))
    passed = [] if states is not None else seeds
    with ReadScope(mapping, collect_losses=True, held=held, passed=passed) as scope:
        yield scope


def _weighted(term: Term, value: tf.Tensor) -> tf.Tensor:
    return value if term.weight == 1.0 else term.weight * value


def _share(x: Any, examples: Any, dtype: Any) -> tf.Tensor:
    return tf.cast(batch_size_of(x), dtype) / tf.cast(examples, dtype)  # n_t / B

"""Loss terms that couple a batch's examples: computed from the whole batch,
or refused by name (docs/coupled-losses.md).

A tower's share of a term is one device's for a mean over the examples or
a term that reads none; a term that couples them is not (keras_hub's
router loss ``E * sum_e f_e P_e``, a product of batch means).
``coupled_losses``: ``"exact"`` computes it from the whole batch
(``balancing.py``; a coupled ``compute_loss`` gathered, ``whole_batch.py``),
``"per_tower"`` on each shard, warned of, ``"refuse"`` refuses it. Any
other term is probed on the first batch (``probe.py``)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras import layers_of, own_losses, patches
from towers.split import batch_size_of
from towers.step.rules.balancing import (
    FUNCTION,
    coupled_terms,
    over_the_batch,
    why_not_exact,
)
from towers.step.rules.loss_kinds import shares_of_terms
from towers.step.rules.loss_terms import probe_terms
from towers.step.rules.probe import Measured

POLICIES = ("exact", "per_tower", "refuse")


class CoupledLosses:
    """What the engine does with the coupled loss terms of its model.

    Args:
      model: the engine's model (tower 0's); None with one tower.
      towers: the towers the batch is split over, every worker's counted.
      policy: one of :data:`POLICIES`.
      accumulate_steps: micro-batches per update (a whole batch's term cannot
        be exact over micro-batches taken one at a time).
      local_towers: this worker's towers (``towers`` outside a cluster).

    Raises:
      ValueError: an unknown policy; a coupled term the policy refuses or
        ``"exact"`` cannot serve, named with its layer and the ways on.

    Example:
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> CoupledLosses(model, towers=2).exact
      False
    """

    def __init__(
        self,
        model: keras.Model | None,
        towers: int,
        policy: Any = "exact",
        accumulate_steps: int = 1,
        local_towers: int | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(
                f"coupled_losses must be one of {list(POLICIES)}; received {policy!r}"
            )
        self.policy, self.towers = policy, towers
        self.local_towers = local_towers or towers
        self.accumulate_steps = accumulate_steps
        # add_loss terms that sum over the examples, (layer path, index):
        # each tower's is added unweighted (found by the probe).
        self.sums: list[tuple[str, int]] = []
        self.terms = coupled_terms(model) if towers > 1 else []
        self.exact = False
        # The model's compute_loss is computed on the gathered batch
        # (towers/step/rules/whole_batch.py), in towers' step or in the model's own.
        self.gathered = False
        splits = towers > 1 or accumulate_steps > 1
        self.probed: list[Measured] | None = None if splits else []
        self._evaluated = not splits  # an evaluation has been probed
        self._patch = patches.module_functions(
            [sys.modules[name] for name in {term.module for term in self.terms}],
            FUNCTION,
            over_the_batch,
        )
        if not self.terms:
            return
        named = "; ".join(str(term) for term in self.terms)
        if policy == "per_tower":
            return  # warned of at the first step, with what it changes
        if policy == "refuse":
            why = "coupled_losses='refuse' refuses them"
        else:
            why = why_not_exact(self.terms, accumulate_steps)
        if why:
            raise ValueError(
                f"the model has loss terms that couple the batch's examples (a "
                f"product of means over the whole batch): {named}. {towers} towers "
                f"cannot compute them as one device does here: {why}. Pass "
                "coupled_losses='per_tower' to take each tower's term on its own "
                "shard (as MirroredStrategy and Horovod do: the update then "
                "differs from one device's), set the coefficient to 0, or train "
                "on one device."
            )
        self.exact = True

    def describe(self) -> list[str]:
        """One line per coupled term: where it is and how it is computed (a
        term found by the probe: once the first step has run)."""
        per_tower = "per tower, on each tower's shard (coupled_losses='per_tower')"
        how = per_tower
        if self.exact:
            how = (
                "f_e and P_e from the whole batch: token counts and router "
                "probability sums summed over the towers (and workers), one "
                "exchange per block; the gradient as one device's"
            )
        gathered = (
            "on the whole batch's outputs, gathered from every tower; each "
            "tower's gradient through its own slice (towers/step/rules/whole_batch.py)"
        )
        how_probed = gathered if self.gathered else per_tower
        return [f"{term}: {how}" for term in self.terms] + [
            f"{term}: {how_probed}" for term in self.probed or []
        ]

    def probe(
        self,
        model: keras.Model,
        batch: tuple[Any, Any, Any],
        own_loss: bool,
        device: str,
        jit: bool = False,
        training: bool = True,
        learned: Any = None,
    ) -> None:
        """Probes the model's other loss terms once, on the first batch of two or
        more examples: a coupled ``compute_loss`` is gathered under ``"exact"``;
        any other coupled term is refused by name, or warned of (``"per_tower"``).

        Raises:
          ValueError: a term that is not a mean over the examples, which the
            policy refuses. Nothing was updated."""
        done = self.probed is not None or (not training and self._evaluated)
        if done or batch_size_of(batch[0]) < 2:
            return
        if self.terms and not self.exact and training:
            self._warn_per_tower(model, batch[0], device)
        probed = probe_terms(
            model, batch, own_loss, device, training, self.towers, learned
        )
        self._check_sums(probed.sums)
        found = probed.coupled
        named = "; ".join(str(term) for term in found)
        only_own = bool(found) and all(term.own_loss for term in found)
        if only_own and self.policy == "exact":
            why = self._why_not_gathered(jit, probed.outputs_coupled)
            if why:
                raise ValueError(
                    f"the model's compute_loss couples the batch's examples ({named}): "
                    f"towers computes it on the whole batch's gathered outputs, but "
                    f"not {why}. Pass coupled_losses='per_tower' to take each "
                    "tower's on its own shard (as MirroredStrategy does: the update "
                    "then differs from one device's), or train on one device."
                )
            self.gathered = self.exact = True
            self._record(found, probed.sums, training)
            return
        if found and self.policy != "per_tower":
            raise ValueError(
                f"the model has loss terms that are not a mean over the batch's "
                f"examples, so {self.towers} towers' shares of them do not add up "
                f"to one device's: {named}. A term that couples the examples (a "
                "contrastive loss, a normaliser over the batch) or sums them "
                "cannot be made exact across towers. Pass "
                "coupled_losses='per_tower' to take each tower's term on its own "
                "shard (as MirroredStrategy and Horovod do: the update then "
                "differs from one device's), make the term a mean over the "
                "examples, or train on one device."
            )
        if found:
            warnings.warn(
                f"coupled_losses='per_tower': each of the {self.towers} towers "
                f"computes these terms on its own shard, so the update is not one "
                f"device's on the whole batch: {named}",
                stacklevel=4,
            )
        self._record(found, probed.sums, training)

    def _record(self, found: list, sums: list, training: bool) -> None:
        """What a probe found. One before evaluation (``training`` False)
        serves the evaluations only: training probes again, in its mode."""
        self.sums = sums
        if training:
            self.probed = found
        self._evaluated = True

    def probe_again(self) -> None:
        """The next :meth:`probe` runs again (the step's loss changed)."""
        splits = self.towers > 1 or self.accumulate_steps > 1
        self.probed, self.sums = (None if splits else []), []
        self._evaluated = False

    def gather_compute_loss(self) -> None:
        """Keras' ``compute_loss`` of the whole batch, gathered (a loss towers
        cannot take per output), on more than one tower."""
        if self.towers > 1:
            self.gathered = self.exact = True

    def _why_not_gathered(self, jit: bool, outputs_coupled: bool) -> str:
        """Where the whole batch's compute_loss is not built ('' where it is)."""
        if outputs_coupled:
            return (
                "where the model's outputs couple the examples already (its "
                "outputs on the first two examples together are not its outputs "
                "on each alone: the forward pass, not only the loss, needs the "
                "whole batch)"
            )
        if self.accumulate_steps > 1:
            return f"over accumulate_steps={self.accumulate_steps} micro-batches"
        return "with jit_compile=True (pass False)" if jit else ""

    def _check_sums(self, sums: list[tuple[str, int]]) -> None:
        # Refuses an add_loss term that sums over the examples where parts of the
        # batch are weighted by their examples (workers, micro-batches).
        where = [
            what
            for what, splits in (
                ("a cluster's workers", self.towers > self.local_towers),
                (
                    f"accumulate_steps={self.accumulate_steps}",
                    self.accumulate_steps > 1,
                ),
            )
            if splits
        ]
        if sums and where:
            named = ", ".join(f"layer {path}'s add_loss term {i}" for path, i in sums)
            raise ValueError(
                f"the model has add_loss terms that sum over the batch's examples "
                f"({named}); with {' and '.join(where)} each part of the batch is "
                "weighted by its share of the examples, which a sum is not. Make "
                "the term a mean over the examples (ops.mean), or train in one "
                "process without accumulate_steps."
            )

    def _warn_per_tower(self, model: keras.Model, x: Any, device: str) -> None:
        """The warning for keras_hub's terms taken per tower, with their value
        on the first batch and the towers' shares of it."""
        whole, shares = shares_of_terms(model, x, self.local_towers, device)
        apart = abs(whole - shares) / max(abs(whole), abs(shares), 1e-12)
        named = "; ".join(str(term) for term in self.terms)
        warnings.warn(
            f"coupled_losses='per_tower': each of the {self.towers} towers "
            f"computes these terms on its own shard, as MirroredStrategy and "
            f"Horovod do, so the update is not one device's on the whole batch: "
            f"{named}. On the first batch (in training mode) they add up to "
            f"{whole:.6g} on one device and {shares:.6g} as the "
            f"{self.local_towers} towers' shares ({apart:.1%} apart)",
            stacklevel=4,
        )

    def summed_terms(self, model: keras.Model) -> Any:
        """The ``add_loss`` terms the probe found summing over the examples
        (:attr:`sums`, as ``(layer path, index)``), added up; None for none."""
        if not self.sums:
            return None
        layers = {layer.path: layer for layer in layers_of(model)}
        terms = [own_losses(layers[path])[i] for path, i in self.sums]
        return tf.add_n([tf.cast(t, terms[0].dtype) for t in terms])

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Within, the blocks' load-balancing losses take the whole batch's
        ``f_e`` and ``P_e``; each tower's thread enters it."""
        if not self.exact:
            yield
            return
        with self._patch.applied():
            yield

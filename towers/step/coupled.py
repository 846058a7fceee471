"""Loss terms that couple a batch's examples, found before the first step.

Each tower adds the model's own loss terms (``add_loss``, regularisers) weighted
by its share of the step's examples (``towers/step/tower.py``): one device's
term whenever the term is a mean over the examples, or does not depend on them.
A term that couples the examples is not. keras_hub's mixture-of-experts blocks
add a router load-balancing loss ``E · Σ_e f_e · P_e``, with ``f_e`` the share
of the tokens routed to expert ``e`` and ``P_e`` its mean router probability,
both means over the whole batch: a product of two batch means, which the
towers' shares of it do not add up to, however weighted.

Such a term is refused by name before the first step, unless the engine is
told to take it per tower (``coupled_losses="per_tower"``), as MirroredStrategy
and Horovod compute it: the update is then not one device's on the whole batch,
and a warning says so once. With one tower on one worker nothing is split, and
nothing is refused. A block whose coefficient is 0 adds nothing, and is exact.

The blocks are found by their class names, as keras-hub 0.32.0 names them.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from towers._keras import layers_of

# keras_hub's mixture-of-experts blocks, and the attribute of their
# load-balancing loss's coefficient.
COUPLED = {
    "MixtralSparseMoeBlock": "router_aux_loss_coef",
    "QwenSparseMoeBlock": "router_aux_loss_coefficient",
    "Qwen3SparseMoeBlock": "router_aux_loss_coefficient",
    "Qwen3_5MoeSparseMoeBlock": "router_aux_loss_coefficient",
}
POLICIES = ("refuse", "per_tower")


def coupled_terms(model: keras.Model) -> list[str]:
    """Each loss term of ``model`` that couples a batch's examples, named by
    its layer.

    >>> coupled_terms(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    []
    """
    found = []
    for layer in layers_of(model):
        attribute = COUPLED.get(type(layer).__name__)
        if attribute is None or not type(layer).__module__.startswith("keras_hub"):
            continue
        coefficient = float(getattr(layer, attribute, 0.0) or 0.0)
        if coefficient:
            found.append(
                f"layer {layer.path} ({type(layer).__name__}) adds a router "
                f"load-balancing loss ({attribute}={coefficient:g})"
            )
    return found


def check_coupled(model: keras.Model, towers: int, policy: Any) -> None:
    """Refuses (or, with ``policy="per_tower"``, warns of) a loss term of
    ``model`` that couples the batch's examples, when the batch is split over
    ``towers`` towers (every worker's counted).

    Raises:
      ValueError: ``policy`` is not one of :data:`POLICIES`; or a coupled term
        under ``"refuse"``, named with its layer and the ways on.
    """
    if policy not in POLICIES:
        raise ValueError(
            f"coupled_losses must be one of {list(POLICIES)}; received {policy!r}"
        )
    found = coupled_terms(model) if towers > 1 else []
    if not found:
        return
    terms = "; ".join(found)
    if policy == "per_tower":
        warnings.warn(
            f"coupled_losses='per_tower': each of the {towers} towers computes "
            f"these terms on its own shard, as MirroredStrategy and Horovod do, so "
            f"the update is not one device's on the whole batch: {terms}",
            stacklevel=4,
        )
        return
    raise ValueError(
        f"the model has loss terms that couple the batch's examples (a product "
        f"of means over the whole batch), which {towers} towers cannot yet "
        f"compute as one device does: {terms}. Pass "
        "coupled_losses='per_tower' to take each tower's term on its own shard "
        "(as MirroredStrategy and Horovod do: the update then differs from one "
        "device's), set the coefficient to 0, or train on one device."
    )

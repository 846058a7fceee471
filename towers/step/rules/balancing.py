"""keras_hub's mixture-of-experts load-balancing loss: which blocks add it
(:func:`coupled_terms`), and its value of the whole batch in place of each
block module's own under ``coupled_losses="exact"`` (``coupled.py``).

A block adds ``E · Σ_e f_e · P_e`` (``f_e``: the share of unmasked tokens
routed to expert ``e``; ``P_e``: its mean router probability), both over the
whole batch: each tower counts its tokens, the sums meet in one exchange,
and every tower computes the whole batch's term."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import keras
import tensorflow as tf

from towers._keras import layers_of
from towers.step.run import seats

# keras_hub's mixture-of-experts blocks, and the attribute of their
# load-balancing loss's coefficient.
COUPLED = {
    "MixtralSparseMoeBlock": "router_aux_loss_coef",
    "QwenSparseMoeBlock": "router_aux_loss_coefficient",
    "Qwen3SparseMoeBlock": "router_aux_loss_coefficient",
    "Qwen3_5MoeSparseMoeBlock": "router_aux_loss_coefficient",
}
# The keras-hub versions whose load-balancing losses "exact" was checked on
# against Keras' own fit (tests/step/rules/test_coupled.py).
CHECKED_KERAS_HUB = ("0.32.0",)
# The function each block's module defines and its call() calls.
FUNCTION = "compute_load_balancing_loss"


@dataclasses.dataclass(frozen=True)
class Term:
    """A loss term that couples a batch's examples: the layer that adds it,
    and the module whose ``compute_load_balancing_loss`` it calls."""

    layer: str
    block: str
    attribute: str
    coefficient: float
    module: str

    def __str__(self) -> str:
        return (
            f"layer {self.layer} ({self.block}) adds a router load-balancing "
            f"loss ({self.attribute}={self.coefficient:g})"
        )


def coupled_terms(model: keras.Model) -> list[Term]:
    """Each loss term of ``model`` that couples a batch's examples.

    >>> coupled_terms(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    []
    """
    found = []
    for layer in layers_of(model):
        attribute = COUPLED.get(type(layer).__name__)
        module = type(layer).__module__
        if attribute is None or not module.startswith("keras_hub"):
            continue
        coefficient = float(getattr(layer, attribute, 0.0) or 0.0)
        if coefficient:
            found.append(
                Term(layer.path, type(layer).__name__, attribute, coefficient, module)
            )
    return found


def load_balancing_over_towers(
    router_logits: tf.Tensor,
    num_experts: int,
    top_k: int,
    attention_mask: tf.Tensor | None = None,
) -> tf.Tensor:
    """keras_hub's ``compute_load_balancing_loss`` of the whole batch, from
    every tower's token counts and probability sums. A token is unmasked as
    each block reads ``attention_mask`` (``[B, S]`` padding in Mixtral; a
    ``[B, S, S]`` row with any key in the Qwen blocks). The counts take no
    gradient; the sums' upstream gradients are summed over the towers, as one
    device's backward pass through the whole batch's ``P_e``. In float32
    (float64 for a float64 model), as the blocks' masks promote it."""
    probabilities = tf.nn.softmax(router_logits, axis=-1)
    _, chosen = tf.math.top_k(probabilities, k=top_k)
    dtype = tf.float64 if probabilities.dtype == tf.float64 else tf.float32
    probabilities = tf.cast(probabilities, dtype)
    tokens = tf.shape(router_logits)[0]
    mask = _token_mask(attention_mask, tokens, dtype)[:, None]
    routed = tf.reduce_mean(tf.one_hot(chosen, num_experts, dtype=dtype), axis=1)
    counts = tf.concat(
        [tf.reduce_sum(routed * mask, 0), tf.reduce_sum(mask, 0)], axis=0
    )  # per expert its routed tokens, then the unmasked tokens
    sums, counts = _summed(tf.reduce_sum(probabilities * mask, 0), counts)
    unmasked = tf.maximum(counts[-1], tf.constant(1e-9, dtype))
    share, mean_probability = counts[:-1] / unmasked, sums / unmasked
    return tf.reduce_sum(share * mean_probability) * num_experts


def _token_mask(attention_mask: Any, tokens: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """Per token of the flattened ``[B * S]``, 1 where it counts, as the blocks
    read their mask (every token without one)."""
    if attention_mask is None:
        return tf.ones([tokens], dtype)
    mask = tf.convert_to_tensor(attention_mask)
    if mask.shape.rank == 3:
        mask = tf.reduce_any(tf.cast(mask, tf.bool), axis=-1)
    else:  # Mixtral's padding mask, its rows cut to the logits' (as it does)
        mask = mask[: tokens // tf.shape(mask)[1]]
    return tf.reshape(tf.cast(mask, dtype), [-1])


def _summed(sums: tf.Tensor, counts: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    # sums and counts over the towers in one exchange; sums' gradients summed back.
    size = tf.shape(sums)[0]
    counts = tf.stop_gradient(counts)

    @tf.custom_gradient
    def summed(local: tf.Tensor):
        both = seats.total(tf.concat([local, counts], 0))

        def gradient(upstream: Any, _: Any) -> tf.Tensor:
            upstream = tf.zeros_like(local) if upstream is None else upstream
            return seats.total(upstream, backward=True)

        return (both[:size], both[size:]), gradient

    return summed(sums)


def why_not_exact(terms: list[Term], accumulate_steps: int) -> str:
    """Why ``"exact"`` cannot serve ``terms`` ('' when it can)."""
    version = getattr(sys.modules.get("keras_hub"), "__version__", "unknown")
    if version not in CHECKED_KERAS_HUB:
        return (
            f"their exact form was checked on keras-hub {list(CHECKED_KERAS_HUB)}; "
            f"received keras-hub {version}"
        )
    missing = [t.module for t in terms if not hasattr(sys.modules[t.module], FUNCTION)]
    if missing:
        return f"{missing} define no {FUNCTION}"
    if accumulate_steps > 1:
        return (
            f"accumulate_steps={accumulate_steps} takes the batch in micro-batches, "
            "one at a time, and the term is a product of means over all of them"
        )
    return ""


def over_the_batch(own: Any) -> Any:
    """A block module's ``compute_load_balancing_loss``, computed from the
    tokens of every tower its seat meets (``own`` is not called)."""
    del own
    return load_balancing_over_towers

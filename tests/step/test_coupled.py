"""A loss term that couples the batch's examples (keras_hub's mixture-of-experts
load balancing) is refused by name on more than one tower, or taken per tower
with a warning when asked; never trained to other weights in silence."""

import warnings

import keras
import keras_hub
import numpy as np
import pytest

from tests.test_equivalence import devices
from towers import Towers


def mixtral(coefficient=0.02):
    return keras_hub.models.MixtralBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=16, num_experts=4, top_k=2,
        router_aux_loss_coef=coefficient,
    )  # fmt: skip


def qwen3_moe():
    return keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=16, moe_intermediate_dim=8, num_experts=4,
        top_k=2, head_dim=8,
    )  # fmt: skip


def engine(build, num_towers, **options):
    keras.utils.set_random_seed(0)
    return Towers(build, "mse", "sgd", devices(num_towers), **options)


@pytest.mark.parametrize(
    "build, block",
    [(mixtral, "MixtralSparseMoeBlock"), (qwen3_moe, "Qwen3SparseMoeBlock")],
    ids=["mixtral", "qwen3_moe"],
)
def test_a_moe_load_balancing_loss_is_refused_by_name_on_two_towers(build, block):
    with pytest.raises(ValueError, match=rf"layer \S+ \({block}\) adds a router "):
        engine(build, 2)


def test_per_tower_takes_it_with_a_warning_and_one_tower_or_no_term_is_exact():
    with pytest.warns(UserWarning, match="each of the 2 towers computes these"):
        engine(mixtral, 2, coupled_losses="per_tower")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(mixtral, 1)  # nothing split
        engine(lambda: mixtral(coefficient=0.0), 2)  # nothing added
    with pytest.raises(ValueError, match="coupled_losses must be one of"):
        engine(mixtral, 2, coupled_losses="mean")


def test_a_per_tower_engine_trains():
    with pytest.warns(UserWarning, match="each of the 2 towers"):
        eng = engine(mixtral, 2, coupled_losses="per_tower")
    batch = {
        "token_ids": np.ones((3, 4), "int32"),
        "padding_mask": np.ones((3, 4), "int32"),
    }
    logs = eng.train_step(batch, np.zeros((3, 4, 16), "float32"))
    assert np.isfinite(float(logs["loss"]))

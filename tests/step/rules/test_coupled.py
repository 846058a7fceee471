"""A loss term that couples the batch's examples (keras_hub's mixture-of-experts
load balancing) trains as on one device: its token counts and router
probabilities summed over the towers (towers/step/rules/coupled.py). Or it is taken
per tower with a warning when asked, or refused by name; never trained to
other weights in silence.

The reference is Keras' own fit on one device, with the same compiled model,
data and call: 9 sequences with padding, per-token sample weights, one step,
split 5 + 4 on 2 towers and 3 + 2 + 2 + 2 on 4. float32, because keras_hub's
MoE blocks mix a float32 mask into a float64 model and fail in Keras' own fit;
each variable's update must be within 2e-3 of its largest entry (per tower,
the gate's update is off by 9 % on 2 towers and 226 % on 4).
"""

import re
import warnings

import keras
import keras_hub
import numpy as np
import pytest

from tests.test_equivalence import devices
from towers import Towers
from towers.step.rules import balancing
from towers.step.run import runner

UPDATE_RTOL = 2e-3
TINY = dict(
    vocabulary_size=50, num_layers=2, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=16, num_experts=4, top_k=2,
)  # fmt: skip
FAMILIES = {
    "mixtral": lambda coefficient: keras_hub.models.MixtralCausalLM(
        keras_hub.models.MixtralBackbone(
            **TINY, intermediate_dim=16, router_aux_loss_coef=coefficient
        ),
        preprocessor=None,
    ),
    "qwen_moe": lambda coefficient: keras_hub.models.QwenMoeCausalLM(
        keras_hub.models.QwenMoeBackbone(
            **TINY,
            intermediate_dim=16,
            moe_intermediate_dim=8,
            shared_expert_intermediate_dim=8,
            router_aux_loss_coefficient=coefficient,
        ),  # fmt: skip
        preprocessor=None,
    ),
    "qwen3_moe": lambda coefficient: keras_hub.models.Qwen3MoeCausalLM(
        keras_hub.models.Qwen3MoeBackbone(
            **TINY,
            intermediate_dim=16,
            moe_intermediate_dim=8,
            head_dim=8,
            router_aux_loss_coefficient=coefficient,
        ),  # fmt: skip
        preprocessor=None,
    ),
    "qwen3_5_moe": lambda coefficient: keras_hub.models.Qwen3_5MoeCausalLM(
        keras_hub.models.Qwen3_5MoeBackbone(
            **{**TINY, "num_layers": 1},
            layer_types=["full_attention"],
            head_dim=8,
            moe_intermediate_dim=8,
            shared_expert_intermediate_size=8,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            router_aux_loss_coefficient=coefficient,
        ),  # fmt: skip
        preprocessor=None,
    ),
    # GPT-OSS routes its tokens with no load-balancing loss (keras-hub 0.32.0):
    # nothing couples its examples, and towers finds nothing to make exact.
    "gpt_oss": lambda coefficient: keras_hub.models.GptOssCausalLM(
        keras_hub.models.GptOssBackbone(
            **TINY, intermediate_dim=16, head_dim=8
        ),  # fmt: skip
        preprocessor=None,
    ),
}


def causal_lm(family, coefficient=0.02):
    """A compiled causal LM of ``family``, the same weights on every call."""

    def build():
        keras.utils.set_random_seed(1)
        model = FAMILIES[family](coefficient)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[],
        )
        return model

    return build


def sequences():
    """9 sequences of 6 tokens, padded at the end to lengths 2..6."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, (9, 6)).astype("int32")
    mask = np.arange(6)[None, :] < np.array([6, 4, 5, 6, 3, 6, 2, 6, 5])[:, None]
    x = {"token_ids": tokens * mask, "padding_mask": mask.astype("int32")}
    y = (rng.integers(0, 50, (9, 6)) * mask).astype("int32")
    return x, y, mask.astype("float32")


def updates(model, build_and_fit):
    """Every trainable variable's update by ``build_and_fit(model)``."""
    before = [v.numpy().copy() for v in model.trainable_variables]
    history = build_and_fit(model)
    after = [v.numpy() for v in model.trainable_variables]
    return [a - b for a, b in zip(after, before)], history


def fit_once(fit):
    x, y, weights = sequences()
    return lambda model: fit(
        x, y, sample_weight=weights, batch_size=9, shuffle=False, verbose=0
    )


def keras_fit(build):
    reference = build()
    return updates(reference, fit_once(lambda *a, **k: reference.fit(*a, **k)))


def assert_updates_close(got, want, variables):
    for g, w, variable in zip(got, want, variables):
        largest = np.abs(w).max()
        np.testing.assert_allclose(
            g, w, rtol=0, atol=UPDATE_RTOL * largest, err_msg=variable.path
        )


@pytest.mark.parametrize(
    "family, num_towers, jit_compile",
    [
        ("mixtral", 2, False),
        ("mixtral", 4, False),
        ("mixtral", 3, True),
        ("qwen3_moe", 2, False),
        ("qwen3_moe", 4, False),
        ("qwen_moe", 2, False),
        ("qwen3_5_moe", 2, False),
    ],
    ids=["mixtral-2", "mixtral-4", "mixtral-3-xla", "qwen3-2", "qwen3-4", "qwen-2",
         "qwen3.5-2"],
)  # fmt: skip
def test_a_moe_causal_lm_trains_as_keras_fit(family, num_towers, jit_compile):
    build = causal_lm(family)
    want, expected = keras_fit(build)
    engine = Towers(build, devices=devices(num_towers), jit_compile=jit_compile)
    assert engine.step.builtin.coupled.exact
    assert engine.step.builtin.jit.enabled is jit_compile
    got, history = updates(engine.model, fit_once(engine.fit))
    assert_updates_close(got, want, engine.model.trainable_variables)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-5
    )


def test_an_empty_shard_adds_nothing_to_the_sums():
    """Batches of 6 and 3 on 4 towers: 2 + 2 + 1 + 1, then 1 + 1 + 1 + 0."""
    build = causal_lm("mixtral")
    x, y, weights = sequences()

    def two_steps(fit):
        return lambda model: fit(
            x, y, sample_weight=weights, batch_size=6, shuffle=False, verbose=0
        )

    reference = build()
    want, _ = updates(reference, two_steps(reference.fit))
    engine = Towers(build, devices=devices(4))
    got, _ = updates(engine.model, two_steps(engine.fit))
    assert_updates_close(got, want, engine.model.trainable_variables)


def test_gpt_oss_adds_no_load_balancing_loss_and_trains_as_keras_fit():
    build = causal_lm("gpt_oss")
    want, _ = keras_fit(build)
    engine = Towers(build, devices=devices(2))
    assert engine.step.builtin.coupled.terms == []
    got, _ = updates(engine.model, fit_once(engine.fit))
    assert_updates_close(got, want, engine.model.trainable_variables)


def test_per_tower_warns_and_trains_to_other_weights():
    # What the exact form fixes: the peers' per-replica term, measured.
    build = causal_lm("mixtral")
    want, _ = keras_fit(build)
    engine = Towers(build, devices=devices(2), coupled_losses="per_tower")
    with pytest.warns(UserWarning, match="each of the 2 towers computes these") as w:
        got, _ = updates(engine.model, fit_once(engine.fit))
    # The warning measures what it changes: the terms on the first batch on
    # one device and as the towers' shares.
    whole, shares, apart = re.search(
        r"add up to (\S+) on one device and (\S+) as the 2 towers' shares "
        r"\((\S+)% apart\)",
        str(w[0].message),
    ).groups()
    assert float(apart) > 0.5 and float(whole) != float(shares)  # measured 1.1 %
    for g, w, variable in zip(got, want, engine.model.trainable_variables):
        if variable.path.endswith("sparse_feedforward_gate_dense/kernel"):
            assert np.abs(g - w).max() > 0.05 * np.abs(w).max(), variable.path


def mixtral_block(coefficient=0.02):
    return keras_hub.models.MixtralBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=16, num_experts=4, top_k=2,
        router_aux_loss_coef=coefficient,
    )  # fmt: skip


def engine(build, num_towers, **options):
    keras.utils.set_random_seed(0)
    return Towers(build, "mse", "sgd", devices(num_towers), **options)


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(coupled_losses="refuse"), "coupled_losses='refuse' refuses them"),
        (dict(accumulate_steps=2), "accumulate_steps=2 takes the batch in micro"),
    ],
    ids=["refuse", "micro-batches"],
)
def test_what_exact_cannot_serve_is_refused_by_name(options, why):
    with pytest.raises(ValueError, match=r"layer \S+ \(MixtralSparseMoeBlock\) adds"):
        engine(mixtral_block, 2, **options)
    with pytest.raises(ValueError, match=why):
        engine(mixtral_block, 2, **options)


def test_another_keras_hub_version_is_refused_naming_both(monkeypatch):
    monkeypatch.setattr(keras_hub, "__version__", "0.99.0")
    with pytest.raises(ValueError, match=r"checked on keras-hub \['0.32.0'\]; rece"):
        engine(mixtral_block, 2)
    engine(mixtral_block, 1)  # one tower: nothing split, nothing refused


def test_one_tower_or_no_term_changes_nothing_and_warns_of_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not engine(mixtral_block, 1).step.builtin.coupled.terms
        zero = engine(lambda: mixtral_block(coefficient=0.0), 2)
        assert not zero.step.builtin.coupled.terms
    with pytest.raises(ValueError, match="coupled_losses must be one of"):
        engine(mixtral_block, 2, coupled_losses="mean")


def test_the_blocks_own_function_is_back_after_each_trace():
    # The whole-batch form is patched in only while towers trace in lockstep.
    from keras_hub.src.models.mixtral import mixtral_decoder

    own = mixtral_decoder.compute_load_balancing_loss
    eng = engine(mixtral_block, 2)
    batch = {
        "token_ids": np.ones((3, 4), "int32"),
        "padding_mask": np.ones((3, 4), "int32"),
    }
    logs = eng.train_step(batch, np.zeros((3, 4, 16), "float32"))
    assert np.isfinite(float(logs["loss"]))
    assert mixtral_decoder.compute_load_balancing_loss is own
    assert balancing.FUNCTION == own.__name__


def test_without_xla_the_moe_pass_is_cut_where_it_sums_not_run_in_lockstep(
    monkeypatch,
):
    # The load-balancing terms meet by sums alone, so the pass is traced once
    # and cut there, as under XLA; the lockstep is for gathered losses.
    def in_turns(*args):
        raise AssertionError("the towers were traced in turns")

    monkeypatch.setattr(runner, "in_turns", in_turns)
    build = causal_lm("mixtral")
    want, _ = keras_fit(build)
    engine = Towers(build, devices=devices(3), jit_compile=False)
    got, _ = updates(engine.model, fit_once(engine.fit))
    assert_updates_close(got, want, engine.model.trainable_variables)

"""Real models nobody on the project wrote, against Keras' own ``fit`` on one
device: ``keras.applications`` (``weights=None``, 32×32 inputs) and keras_hub
models built from tiny configs (GPT-2, Llama, Gemma3, ViT; nothing is
downloaded). MobileNetV2 is the application as published; ResNet and ConvNeXt
are Keras' own builders of ResNet50 and ConvNeXtTiny with fewer, narrower
blocks (every kind of layer and join they have, at a tenth of the time).

Deep models amplify rounding, so they run in float64, where a mismatch is the
engine's, not noise; and each variable's update (after − before) is compared,
moving statistics included, not only the weights (the update is what a bug
changes; the weights hide it under their initial values). Two steps of 7
examples: each splits unevenly, 4 + 3, on 2 towers.
"""

from functools import partial

import keras
import keras_hub
import numpy as np
import pytest
from keras.src.applications.convnext import ConvNeXt
from keras.src.applications.resnet import ResNet
from keras.src.applications.resnet import stack_residual_blocks_v1 as resnet_blocks

from tests.test_equivalence import devices
from tests.tolerances import (
    FLOAT32_SOFTMAX_UPDATE_ATOL,
    FLOAT64_UPDATE_ATOL,
    FLOAT64_UPDATE_RTOL,
)
from towers import Towers
from towers.training import check

EXAMPLES, BATCH = 14, 7


def resnet(**kwargs):
    """Keras' ResNet50 builder with two stacks of one bottleneck block:
    projection shortcuts, two BatchNormalization branches into one Add."""

    def stacks(x):
        x = resnet_blocks(x, 16, 1, stride1=1, name="conv2")
        return resnet_blocks(x, 32, 1, name="conv3")

    return ResNet(stacks, preact=False, use_bias=True, name="resnet", **kwargs)


def convnext(**kwargs):
    """Keras' ConvNeXtTiny builder with one block a stage, 8 to 64 channels:
    depthwise 7x7 convolutions, LayerNormalization, LayerScale, GELU."""
    return ConvNeXt(depths=[1, 1, 1, 1], projection_dims=[8, 16, 32, 64], **kwargs)


APPLICATIONS = {
    # depthwise convolutions, ReLU6, 52 BN layers
    "MobileNetV2": partial(keras.applications.MobileNetV2, alpha=0.35),
    "ResNet": resnet,
    "ConvNeXt": convnext,
}


def assert_same_updates(engine_model, reference, before, atol=FLOAT64_UPDATE_ATOL):
    """Every variable's update equal to Keras', relative to itself, with an
    absolute floor at the model's largest update (an update that is 0 on one
    device, a bias before BatchNormalization, is rounding there)."""
    want = [w - b for w, b in zip(reference.get_weights(), before)]
    got = [w - b for w, b in zip(engine_model.get_weights(), before)]
    largest = max(np.abs(u).max() for u in want)
    assert largest > 0
    for g, w, var in zip(got, want, reference.weights):
        np.testing.assert_allclose(
            g,
            w,
            rtol=FLOAT64_UPDATE_RTOL,
            atol=atol * largest,
            err_msg=var.path,
        )


def application(name):
    def build():
        return APPLICATIONS[name](weights=None, input_shape=(32, 32, 3), classes=5)

    return build


@pytest.mark.parametrize("name", APPLICATIONS)
def test_a_keras_application_trains_as_keras_fit(name, float64):
    trains_as_keras_fit(name, jit_compile=False)


def test_resnet_with_xla_trains_as_keras_xla_fit(float64, xla_allowed):
    """Global batch statistics under XLA: each tower's pass in XLA computations
    cut at its 9 BatchNormalization layers, two of them branches into one Add
    (towers/step/run/phases.py), against Keras' fit with XLA on one device. One
    step of 8, 4 + 4: every phase compiles once per shard shape and device,
    and the small models cover uneven shards (tests/step/run/test_phases.py)."""
    trains_as_keras_fit("ResNet", jit_compile=True, examples=8, batch=8)


def trains_as_keras_fit(name, jit_compile, examples=EXAMPLES, batch=BATCH):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, 32, 32, 3))
    y = rng.integers(0, 5, examples)
    build, loss = application(name), keras.losses.SparseCategoricalCrossentropy()
    engine = Towers(
        build,
        loss,
        keras.optimizers.SGD(0.01),
        devices=devices(2),
        batch_statistics="global",
        jit_compile=jit_compile,
    )
    assert engine.step.builtin.jit.enabled is jit_compile
    reference = build()
    reference.set_weights(engine.model.get_weights())
    reference.compile(
        optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit_compile
    )
    assert reference.jit_compile is jit_compile  # Keras' side really compiles
    before = reference.get_weights()

    engine.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)


# keras_hub causal LMs from tiny configs: vocabulary 64, 2 layers, hidden 16.
# GPT-2's dropout draws are one device's (towers/step/rules/draws.py).
CAUSAL_LMS = {
    "GPT2": lambda: keras_hub.models.GPT2CausalLM(
        backbone=keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=8,
            dropout=0.2,
        ),
        preprocessor=None,
    ),
    # Grouped-query attention, rotary embeddings, RMS norms.
    "Llama": lambda: keras_hub.models.LlamaCausalLM(
        backbone=keras_hub.models.LlamaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=16,
            intermediate_dim=32,
        ),
        preprocessor=None,
    ),
    # Query-key norm; text only (no vision encoder). Its attention softmax is
    # float32 (FLOAT32_SOFTMAX_UPDATE_ATOL).
    "Gemma3": lambda: keras_hub.models.Gemma3CausalLM(
        backbone=keras_hub.models.Gemma3Backbone(
            vocabulary_size=64,
            image_size=16,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=16,
            intermediate_dim=32,
            head_dim=8,
        ),
        preprocessor=None,
    ),
}


def causal_lm(name="GPT2", jit_compile=False):
    model = CAUSAL_LMS[name]()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
        jit_compile=jit_compile,
    )
    assert model.jit_compile is jit_compile  # Keras' side really compiles
    return model


@pytest.mark.parametrize(
    "name, jit_compile",
    [("GPT2", False), ("GPT2", True), ("Llama", False), ("Gemma3", False)],
)
def test_a_keras_hub_causal_lm_trains_as_keras_fit(float64, name, jit_compile, request):
    """Dict inputs, a padding mask, and per-token sample weights (padding weighs
    0); with XLA, each tower's pass one XLA computation against Keras' own XLA
    fit (op determinism, on in this suite, makes Keras refuse XLA: off here)."""
    if jit_compile:
        request.getfixturevalue("xla_allowed")
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 64, (EXAMPLES, 9))
    lengths = rng.integers(3, 9, EXAMPLES)
    mask = np.arange(8)[None, :] < lengths[:, None]
    x = {"token_ids": tokens[:, :-1] * mask, "padding_mask": mask}
    y, weights = tokens[:, 1:] * mask, mask.astype("float64")
    engine = Towers(causal_lm(name, jit_compile), devices=devices(2))
    assert engine.step.builtin.jit.enabled is jit_compile
    reference = causal_lm(name, jit_compile)
    for theirs, mine in zip(reference.variables, engine.model.variables, strict=True):
        theirs.assign(mine)  # the dropout layers' seed states too
    before = reference.get_weights()

    history = engine.fit(
        x, y, batch_size=BATCH, sample_weight=weights, shuffle=False, verbose=0
    )
    expected = reference.fit(
        x, y, batch_size=BATCH, sample_weight=weights, shuffle=False, verbose=0
    )

    atol = FLOAT32_SOFTMAX_UPDATE_ATOL if name == "Gemma3" else FLOAT64_UPDATE_ATOL
    assert_same_updates(engine.model, reference, before, atol)
    np.testing.assert_allclose(
        history.history["sparse_categorical_accuracy"],
        expected.history["sparse_categorical_accuracy"],
    )


def vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3),
        patch_size=4,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
    )
    model = keras_hub.models.ViTImageClassifier(
        backbone=backbone, num_classes=5, preprocessor=None
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_a_keras_hub_vit_classifier_trains_as_keras_fit(float64):
    """Patches, a class token, position embeddings, layer norms."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((EXAMPLES, 8, 8, 3))
    y = rng.integers(0, 5, EXAMPLES)
    engine = Towers(vit(), devices=devices(2))
    reference = vit()
    reference.set_weights(engine.model.get_weights())
    before = reference.get_weights()

    engine.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    assert_same_updates(engine.model, reference, before)


def test_mobilenetv2_in_float32_passes_its_first_step_check_on_4_towers():
    """In float32 rounding tips a ReLU6 gate or a BatchNormalization channel
    one way on one device and the other on the towers, moving every layer
    before it: this model and batch differ from one device by 3.5 % on a
    variable (float64: 4e-13). No alarm: the check is past rounding's reach."""
    keras.utils.set_random_seed(3)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), classes=10, alpha=0.35
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy"
    )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 32)
    engine = Towers(model, devices=devices(4))
    shown = engine.check(x, y)
    worst = max(d.relative for d in shown.differences if "moving" not in d.path)
    assert 0.01 < worst < 0.1 and not shown.differs  # rounding's, not refused
    engine.fit(x, y, batch_size=32, verbose=0)  # the first step's check passes
    assert engine.steps_done == 1


def test_float32_rounding_past_the_tolerance_is_cleared_by_the_twin(monkeypatch):
    """Where float32's rounding puts a variable past the check's tolerance,
    the float64 twin tells it from a mechanism: its step is one device's, so
    the model trains. Which variable rounding tips past 15 % depends on the
    machine's kernels (an Adam element whose gradient's sign flips, on some
    CPUs and seeds: 29 % once); so the tolerance is brought to 0.1 %, which
    this model's float32 rounding passes on any machine (3.5 % here)."""
    monkeypatch.setitem(check.RTOL, "float32", 1e-3)
    keras.utils.set_random_seed(3)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), classes=10, alpha=0.35
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy"
    )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 32)
    engine = Towers(model, devices=devices(4))
    shown = engine.check(x, y)
    apart = [d.path for d in shown.differences if d.differs]
    assert apart and shown.rounding and not shown.differs, shown.verdict()
    assert shown.twin is not None and not shown.twin.differs
    engine.fit(x, y, batch_size=32, verbose=0, shuffle=False)
    assert engine.steps_done == 1

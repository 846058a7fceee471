"""A model's compute_loss that couples the batch's examples (a contrastive
loss) is computed on the whole batch's gathered outputs, so T towers train to
Keras' own fit on one device (``towers/step/rules/whole_batch.py``). Compared in
float64, every variable's update, the logs and evaluate, on batches that do
not divide by the towers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_equivalence import devices
from tests.tolerances import ADAM_EPSILON, FLOAT64_UPDATE_RTOL
from towers import Towers

EXAMPLES, BATCH = 22, 10  # batches of 10, 10 and 2: uneven over 3 towers


class Clip(keras.Model):
    """A two-tower (image, text) model with CLIP's loss: the symmetric
    cross-entropy over the batch's similarity matrix, scaled by a learned
    temperature (read by the loss straight from its variable), plus the
    compiled losses (a loss tracker per output) and the layers' regularisers
    (Keras' compute_loss). Its own metric, a Sum (counted twice would
    show), counts the pairs the loss matched."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        self.matched = keras.metrics.Sum(name="matched")

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        images, texts = y_pred
        images = images / keras.ops.norm(images, axis=1, keepdims=True)
        texts = texts / keras.ops.norm(texts, axis=1, keepdims=True)
        logits = keras.ops.matmul(images, keras.ops.transpose(texts))
        logits = logits * keras.ops.exp(self.scale)
        labels = keras.ops.arange(keras.ops.shape(logits)[0])
        crossed = [
            keras.losses.sparse_categorical_crossentropy(labels, z, from_logits=True)
            for z in (logits, keras.ops.transpose(logits))
        ]
        found = keras.ops.cast(keras.ops.argmax(logits, axis=1), labels.dtype)
        hits = keras.ops.cast(found == labels, "float64")
        self.matched.update_state(hits)
        return loss + keras.ops.mean(crossed[0] + crossed[1]) / 2


def clip():
    keras.utils.set_random_seed(3)
    images = keras.Input((6,), name="images")
    texts = keras.Input((5,), name="texts")
    dense = dict(
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(0.01),
        activity_regularizer=keras.regularizers.L2(0.001),
    )
    image_out = keras.layers.Dense(4, name="image")(
        keras.layers.Dense(8, **dense)(images)
    )
    text_out = keras.layers.Dense(4, name="text")(keras.layers.Dense(8, **dense)(texts))
    model = Clip({"images": images, "texts": texts}, [image_out, text_out])
    model.compile(
        optimizer=keras.optimizers.Adam(0.05, epsilon=ADAM_EPSILON), loss=["mse", "mse"]
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = {
        "images": rng.standard_normal((EXAMPLES, 6)),
        "texts": rng.standard_normal((EXAMPLES, 5)),
    }
    return x, [rng.standard_normal((EXAMPLES, 4)) for _ in range(2)]


def fit_both(num_towers, **options):
    """towers' and Keras' fit (two epochs) from the same weights: every
    variable's update, each's history, and each's evaluate."""
    x, y = data()
    engine = Towers(clip(), devices=devices(num_towers), **options)
    reference = clip()
    reference.set_weights(engine.model.get_weights())
    before = [v.numpy() for v in reference.variables]
    got = engine.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    runs = []
    for model, history in ((engine.model, got), (reference, want)):
        moved = [v.numpy() - b for v, b in zip(model.variables, before)]
        runs.append((moved, history.history))
    scores = [
        run.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        for run in (engine, reference)
    ]
    return runs, scores


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_clip_loss_trains_to_keras_fit_on_the_whole_batch(float64, num_towers):
    (got, want), scores = fit_both(num_towers)

    (moved, history), (moved_keras, history_keras) = got, want
    assert len(moved) == len(moved_keras)
    for g, w in zip(moved, moved_keras):
        np.testing.assert_allclose(g, w, rtol=FLOAT64_UPDATE_RTOL, atol=1e-12)
    assert all(np.abs(m).max() > 0 for m in moved[:-1])  # the temperature too
    assert history.keys() == history_keras.keys()
    for key in history_keras:
        np.testing.assert_allclose(history[key], history_keras[key], rtol=1e-9)
    assert scores[0].keys() == scores[1].keys()
    for key in scores[1]:
        np.testing.assert_allclose(scores[0][key], scores[1][key], rtol=1e-9)


def test_per_tower_is_what_it_says_not_keras_fit(float64):
    """The control: each tower's loss on its own shard moves other weights."""
    with pytest.warns(UserWarning, match=r"Clip.compute_loss is .*% apart"):
        (got, want), _ = fit_both(2, coupled_losses="per_tower")
    apart = [np.abs(g - w).max() / np.abs(w).max() for g, w in zip(got[0], want[0])]
    assert max(apart) > 0.01, apart


@pytest.mark.parametrize(
    "options, named",
    [
        ({"accumulate_steps": 2}, "over accumulate_steps=2 micro-batches"),
        ({"jit_compile": True}, "with jit_compile=True"),
    ],
)
def test_what_cannot_gather_is_refused_by_name_before_any_update(options, named):
    x, y = data()
    engine = Towers(clip(), devices=devices(2), **options)
    before = [v.numpy() for v in engine.model.variables]

    with pytest.raises(ValueError) as refused:
        engine.fit(x, y, batch_size=BATCH, verbose=0)

    message = str(refused.value)
    assert "Clip.compute_loss is" in message and named in message
    assert "coupled_losses='per_tower'" in message
    assert int(engine.optimizer.iterations) == 0
    for v, b in zip(engine.model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def siglip():
    """keras_hub's SigLIP from a tiny config: its compute_loss scores every
    image against every text of the batch, with a learned scale and bias."""
    import keras_hub

    keras.utils.set_random_seed(5)
    common = dict(hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=32)
    vision = keras_hub.models.SigLIPVisionEncoder(
        patch_size=4, image_shape=(8, 8, 3), **common
    )
    text = keras_hub.models.SigLIPTextEncoder(
        vocabulary_size=20, embedding_dim=16, max_sequence_length=6, **common
    )
    model = keras_hub.models.SigLIPBackbone(vision, text)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_keras_hubs_siglip_is_refused_naming_its_outputs():
    """SigLIP's backbone computes the image-text logits in its own forward
    pass: its outputs on a shard are not rows of the batch's, so gathering
    them cannot make the loss exact; refused by name, before any update."""
    rng = np.random.default_rng(0)
    x = {
        "images": rng.standard_normal((6, 8, 8, 3)).astype("float32"),
        "token_ids": rng.integers(0, 20, (6, 6)),
    }
    engine = Towers(siglip(), devices=devices(2))
    before = [v.numpy() for v in engine.model.variables]

    with pytest.raises(ValueError) as refused:
        engine.fit(x, batch_size=6, verbose=0)

    message = str(refused.value)
    assert "SigLIPBackbone.compute_loss is" in message
    assert "the model's outputs couple the examples" in message
    assert int(engine.optimizer.iterations) == 0
    for v, b in zip(engine.model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_towers_explain_says_the_loss_is_gathered():
    x, y = data()
    engine = Towers(clip(), devices=devices(2))
    engine.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    described = engine.step.builtin.coupled.describe()
    assert len(described) == 1
    assert described[0].startswith("Clip.compute_loss is")
    assert "gathered from every tower" in described[0]


class OwnStep(Clip):
    """The same loss, called from the model's own train_step and test_step
    (Keras' guide), returning the loss as it is and the Sum its
    compute_loss updates."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, training=True)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss, "matched": self.matched.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(x, y, y_pred, training=False)
        return {"loss": loss, "matched": self.matched.result()}


def own_step_clip():
    model = clip()
    own = OwnStep(model.inputs, model.outputs)
    own.compile(
        optimizer=keras.optimizers.Adam(0.05, epsilon=ADAM_EPSILON), loss=["mse", "mse"]
    )
    return own


@pytest.mark.parametrize("num_towers", [2, 3])
def test_a_coupled_loss_in_the_models_own_step_trains_as_keras_fit(float64, num_towers):
    # The step's compute_loss is the whole batch's on every tower, its
    # gradient through the tower's own rows over its share: one device's.
    x, y = data()
    engine = Towers(own_step_clip(), devices=devices(num_towers))
    reference = own_step_clip()
    reference.set_weights(engine.model.get_weights())
    before = [v.numpy() for v in reference.variables]
    fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    history = engine.fit(x, y, **fit).history
    expected = reference.fit(x, y, **fit).history

    for ours, theirs, b in zip(engine.model.variables, reference.variables, before):
        np.testing.assert_allclose(
            ours.numpy() - b, theirs.numpy() - b, rtol=FLOAT64_UPDATE_RTOL, atol=1e-12
        )
    assert np.abs(engine.model.scale.numpy() - before[0]).max() > 0
    assert history.keys() == expected.keys() == {"loss", "matched"}
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-9)
    scores = [
        run.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        for run in (engine, reference)
    ]
    for key in scores[1]:
        np.testing.assert_allclose(scores[0][key], scores[1][key], rtol=1e-9)


def test_auto_xla_runs_a_gathered_loss_without_it_saying_so(float64):
    # jit_compile="auto" on accelerators: the towers meet to gather the
    # batch's outputs, in turns, which XLA cannot run: the runner says so once.
    from towers.step.run import xla

    x, y = data()
    engine = Towers(clip(), devices=devices(2))
    engine.step.builtin.jit = xla.Jit(enabled=True, strict=False)  # "auto" on GPUs
    reference = clip()
    reference.set_weights(engine.model.get_weights())
    with pytest.warns(UserWarning, match="compute_loss gathers the batch") as caught:
        engine.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert sum("gathers the batch" in str(w.message) for w in caught) == 1
    assert engine.step.builtin.jit == xla.OFF
    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=FLOAT64_UPDATE_RTOL, atol=1e-12)

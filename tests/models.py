"""Small models the tests share: each exercises one kind of gradient."""

import keras
import numpy as np

from towers.training.compiled import traced

NUM_CLASSES = 3
VOCAB = 20


class DenseSparseUnused(keras.Model):
    """Dense layers, an Embedding (IndexedSlices gradients) and an unused weight.

    x: {"dense": f32[B, 6], "ids": i32[B, 4]} -> logits f32[B, 3]
    """

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(VOCAB, 5)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.logits = keras.layers.Dense(NUM_CLASSES)
        # Never used by call(): its gradient is None in every tower.
        self.unused = self.add_weight(shape=(4,), initializer="ones", name="unused")

    def call(self, x):
        ids = keras.ops.mean(self.embed(x["ids"]), axis=1)  # f32[B, 5]
        features = keras.ops.concatenate([x["dense"], ids], axis=-1)  # f32[B, 11]
        return self.logits(self.hidden(features))


def build_dense_sparse_unused() -> keras.Model:
    model = DenseSparseUnused()
    model({"dense": np.zeros((1, 6), "float32"), "ids": np.zeros((1, 4), "int32")})
    return model


def dense_sparse_batch(rng: np.random.Generator, batch: int):
    x = {
        "dense": rng.standard_normal((batch, 6)).astype("float32"),
        # Few ids, so towers often update the same embedding rows.
        "ids": rng.integers(0, VOCAB // 2, (batch, 4)).astype("int32"),
    }
    y = rng.integers(0, NUM_CLASSES, (batch,)).astype("int32")
    return x, y


def regression_batch(rng: np.random.Generator, batch: int, inputs=6, outputs=2):
    """(x: f32[batch, inputs], y: f32[batch, outputs]), standard normal."""
    x = rng.standard_normal((batch, inputs)).astype("float32")
    y = rng.standard_normal((batch, outputs)).astype("float32")
    return x, y


def build_mlp(inputs: int = 6, hidden: int = 16, outputs: int = 2) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(outputs),
        ]
    )


def copy_of(model: keras.Model, builder) -> keras.Model:
    """A second model with the same architecture and the same weights."""
    twin = builder()
    twin.set_weights(model.get_weights())
    return twin


def step_graph(engine, x, y, sample_weight=None):
    """The graph of ``engine``'s training step on a batch like ``(x, y)``: traced
    afresh from the step's public phases, as ``towers explain`` does."""
    x, y, sample_weight = engine.prepare(x, y, sample_weight)
    train = traced(engine.step.train)
    return train.get_concrete_function(x, y, sample_weight).graph

"""Model presets for ``towers bench``: each a builder, a synthetic batch and a loss.

Synthetic data (nothing is downloaded); 10 classes; logits out, so every preset
uses ``SparseCategoricalCrossentropy(from_logits=True)``.

- ``mlp``: 784-512-512-10 dense layers, 0.67 M parameters in 6 tensors: few,
  large gradients.
- ``cnn``: a small convolutional network on 32x32x3 images, 0.32 M parameters in
  8 tensors: more compute per byte of gradient.
- ``embedding``: a 50,000 x 64 embedding table (sparse gradients) under two
  dense layers, 3.2 M parameters: the table is 12.8 MB, but a step touches few
  of its rows.
- ``resnet``: a ResNet-style network (residual blocks of conv + BatchNorm,
  three stages), 78 K parameters in 25 trainable tensors: many small gradients
  and much compute. Its BatchNorm layers keep ``placement="replicated"`` from
  running it (not supported yet); the other placements and the baselines do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np

NUM_CLASSES = 10
VOCAB = 50_000
IDS_PER_EXAMPLE = 20


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model to measure: ``build()`` makes it, ``batch(n, seed)`` feeds it."""

    name: str
    build: Callable[[], keras.Model]
    batch: Callable[[int, int], tuple[np.ndarray, np.ndarray]]

    def loss(self) -> keras.losses.Loss:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build_mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ],
        name="mlp",
    )


def build_cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ],
        name="cnn",
    )


def build_embedding() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((IDS_PER_EXAMPLE,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 64),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ],
        name="embedding",
    )


def build_resnet() -> keras.Model:
    inputs = keras.Input((32, 32, 3))
    x = _conv_bn(inputs, 16, strides=1)
    for filters, strides in [(16, 1), (32, 2), (64, 2)]:
        x = _residual_block(x, filters, strides)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(x), name="resnet")


def _conv_bn(x, filters: int, strides: int, relu: bool = True):
    x = keras.layers.Conv2D(filters, 3, strides, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def _residual_block(x, filters: int, strides: int):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides, use_bias=False)(x)
    y = _conv_bn(x, filters, strides)
    y = _conv_bn(y, filters, 1, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))


def _images(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, NUM_CLASSES, n).astype("int32")


def _vectors(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 784)).astype("float32")
    return x, rng.integers(0, NUM_CLASSES, n).astype("int32")


def _ids(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, IDS_PER_EXAMPLE)).astype("int32")
    return x, rng.integers(0, NUM_CLASSES, n).astype("int32")


PRESETS = {
    "mlp": Preset("mlp", build_mlp, _vectors),
    "cnn": Preset("cnn", build_cnn, _images),
    "embedding": Preset("embedding", build_embedding, _ids),
    "resnet": Preset("resnet", build_resnet, _images),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
      ValueError: an unknown name; the message lists the valid ones.

    Example:
      >>> get_preset("mlp").batch(2, seed=0)[0].shape
      (2, 784)
    """
    if name not in PRESETS:
        raise ValueError(
            f"unknown preset; received {name!r}, expected one of {list(PRESETS)}"
        )
    return PRESETS[name]

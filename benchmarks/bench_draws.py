"""What one device's random draws cost on towers (towers/step/rules/draws.py).

Each tower draws its rows of the batch's numbers as one device draws them
(a uniform or normal draw, Dropout's mask among them, for the tower's rows
alone, its Philox counter moved on past the rows before). This times an
MLP 784-512-512-10 with a Dropout layer
after each hidden layer, global batch 256, SGD, against the same MLP with
dropout rate 0 (Keras then draws nothing), on 8 towers and on one device,
in turns in one process. ``towers: dropout / none`` over ``one device:
dropout / none`` is what the draws cost towers beyond what they cost one
device. No target: it says the price of exact draws on this machine.
"""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.peers import single_device_step
from towers.bench.timing import interleaved, ratio

BATCH, TOWERS = 256, 8


def mlp(rate: float):
    def build() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(rate, seed=1),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(rate, seed=2),
                keras.layers.Dense(10),
            ]
        )

    return build


def test_dropout_on_towers_against_one_device(benchmark):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 784)), tf.float32)
    y = tf.constant(rng.integers(0, 10, BATCH), tf.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    devices = [f"/cpu:{t}" for t in range(TOWERS)]
    steps = {}
    for name, rate in (("dropout", 0.2), ("none", 0.0)):
        engine = Towers(mlp(rate), loss, lambda: keras.optimizers.SGD(0.01),
                        devices=devices)  # fmt: skip
        steps[f"towers_{name}"] = lambda e=engine: e.train_step(x, y)["loss"]
        single = single_device_step(mlp(rate), loss, "/cpu:0")
        steps[f"single_{name}"] = lambda s=single: s(x, y)

    times = interleaved(steps, rounds=12)

    towers = ratio(times, "towers_dropout", "towers_none")
    single = ratio(times, "single_dropout", "single_none")
    record_ratio(benchmark, f"{TOWERS}-tower dropout / none", towers, None)
    record_ratio(benchmark, "one device dropout / none", single, None)

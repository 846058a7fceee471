"""Would XLA pay for a model's own train_step? (issue 49)

A model's own ``train_step`` runs without XLA: its towers meet at every apply,
so XLA could only compile the stretches between meetings. The best such a
step could do is the guide's (``compute_loss``, ``tape.gradient``, one
``optimizer.apply``), whose one stretch is the tower's whole forward and
backward pass: exactly what towers' own step compiles with
``jit_compile=True``. So in one process, in turns, on the MLP preset (global
batch 256, SGD):

- ``own``: the guide's ``train_step``, run by towers (no XLA, as today);
- ``plain``: the same model without it, towers' own step;
- ``plain XLA``: that step with ``jit_compile=True``, each tower's pass one
  XLA computation: the floor a compiled own step could reach.

``plain XLA / plain`` above 1 says XLA cannot make the own step faster on this
machine, and the refusal of ``jit_compile=True`` with an own step stands
(``towers/step/work/own.py``); ``own / plain`` is what running the model's own
code costs over towers' step. No targets: these decide, they do not gate.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.presets import NUM_CLASSES
from towers.bench.timing import interleaved, ratio

BATCH = 256


class GuideStep(keras.Model):
    """Keras' guide "Customizing what happens in fit()"."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


def mlp(cls=keras.Model) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
    model = cls(inputs, keras.layers.Dense(NUM_CLASSES)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("num_towers", [2, 4])
def test_own_step_against_towers_step_with_and_without_xla(benchmark, num_towers):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 784)), tf.float32)
    y = tf.constant(rng.integers(0, NUM_CLASSES, BATCH), tf.int32)
    devices = [f"/cpu:{t}" for t in range(num_towers)]
    engines = {
        "own": Towers(mlp(GuideStep), devices=devices, jit_compile=False),
        "plain": Towers(mlp(), devices=devices, jit_compile=False),
        "plain_xla": Towers(mlp(), devices=devices, jit_compile=True),
    }
    steps = {
        name: (lambda engine=engine: engine.train_step(x, y)["loss"])
        for name, engine in engines.items()
    }

    times = interleaved(steps, rounds=12)

    name = f"{num_towers}-tower"
    record_ratio(
        benchmark,
        f"{name} plain XLA / plain (own step's best)",
        ratio(times, "plain_xla", "plain"),
        None,
        num_towers=num_towers,
        batch=BATCH,
    )
    record_ratio(
        benchmark,
        f"{name} own step / plain",
        ratio(times, "own", "plain"),
        None,
        steps["own"],
    )

"""Why, without XLA, a divisor from sample weights traces the towers one by one
(``step/run/seats.py``'s ``CutSeat`` does not serve the sum in ``"shared"``).

Keras' ``mean_with_sample_weight`` divides by the batch's sum of sample
weights, which no tower knows alone. The one trace for every tower can be cut
at that sum (forward, the towers' sum, backward: what XLA runs), or the
towers traced one by one and the divisor summed between their forward and
backward passes (what runs without XLA). This times both steps on 8 towers,
in turns in one process, the cut one forced by routing the pass to
``"phases"`` while it is traced: an MLP 784-512-512-10 (batch 256) and
MobileNetV2 at 32x32 (alpha 0.35, batch 64), SGD. ``cut / one by one`` above
1 is what the cut would cost each step; its gain is the first step
(MobileNetV2 at 8 towers: 11.6 s against 16.2 s, fresh processes).

Measured here over five runs (with the same comparison by hand): the MLP
0.985 to 1.040 (median 1.014), MobileNetV2 0.972 to 1.053 (median 1.034).
Within the noise of this machine, but above 1 more often than not, so a step
without XLA keeps tracing the towers one by one: a long training pays the
steady step many times, the first step once. No target.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.conftest import record_ratio
from towers import Towers
from towers.bench.presets import build_mlp
from towers.bench.timing import interleaved, ratio
from towers.step.run import runner

TOWERS = 8


def mobilenet() -> keras.Model:
    return keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10
    )


MODELS = {
    "mlp": (build_mlp, (256, 784), 20),
    "MobileNetV2": (mobilenet, (64, 32, 32, 3), 4),
}


def cut_at_the_divisor(monkeypatch):
    """While a step is traced within: the pass sent to the phases."""
    own = runner.Runner.way

    def way(self, kind, working, shards=None):
        chosen = own(self, kind, working, shards)
        return "phases" if kind == "train" and chosen == "shared" else chosen

    monkeypatch.setattr(runner.Runner, "way", way)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_divisors_cut_against_the_towers_one_by_one(benchmark, monkeypatch, name):
    build, shape, per_round = MODELS[name]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(shape), tf.float32)
    y = tf.constant(rng.integers(0, 10, shape[0]), tf.int32)
    w = tf.constant(rng.random(shape[0]), tf.float32)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    devices = [f"/cpu:{t}" for t in range(TOWERS)]
    steps = {}
    for way in ("one_by_one", "cut"):
        engine = Towers(build, loss, lambda: keras.optimizers.SGD(0.01),
                        devices=devices)  # fmt: skip
        with monkeypatch.context() as patched:
            if way == "cut":
                cut_at_the_divisor(patched)
            engine.train_step(x, y, w)  # traced here, the way fixed
        steps[way] = lambda e=engine: e.train_step(x, y, w)["loss"]

    times = interleaved(steps, rounds=10, steps_per_round=per_round)

    record_ratio(
        benchmark, f"{name} {TOWERS} towers: cut / one by one",
        ratio(times, "cut", "one_by_one"), None,
    )  # fmt: skip

"""``steps_per_execution``: fit's steps per second with k = 1, 8 and 32, against
Keras' own fit with the same k (issue 39, item 6).

Two small models, where the host's work between steps is most of a step: the
demo's CNN on 8x8 digit-sized images and a 20-32-3 MLP, 64 batches of 32 an
epoch. Each contender (towers on 2 logical CPUs with k; Keras' fit on one
device with k; towers with k = 1) runs whole one-epoch fits, in turns, round by
round, in this process. Reported: towers k / Keras k (no target: the machine
charges for splitting a small batch over two towers, ``bench_step.py``), and
towers k / towers 1: what running k steps in one call saves, which must not
be a slowdown (target <= 1.0).
"""

import keras
import numpy as np
import pytest

from benchmarks.conftest import RESULTS
from towers import Towers
from towers.bench.timing import interleaved, ratio
from towers.demo import build_cnn

BATCHES, BATCH = 64, 32
ROUNDS = 8


def build_mlp():
    return keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
         keras.layers.Dense(3)]
    )  # fmt: skip


MODELS = {
    "demo cnn": (build_cnn, (8, 8, 1), 10),
    "mlp 20-32-3": (build_mlp, (20,), 3),
}


def data(shape, classes):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCHES * BATCH, *shape)).astype("float32")
    return x, rng.integers(0, classes, len(x)).astype("int32")


def compiled(build, per_execution):
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=per_execution,
    )
    return model


def one_epoch(runner, x, y):
    return lambda: runner.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False
    )


@pytest.mark.parametrize("per_execution", [1, 8, 32])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_steps_per_execution_against_keras_fit(benchmark, model_name, per_execution):
    build, shape, classes = MODELS[model_name]
    x, y = data(shape, classes)
    devices = ["/cpu:0", "/cpu:1"]
    contenders = {
        "towers": one_epoch(
            Towers(compiled(build, per_execution), devices=devices), x, y
        ),
        "keras": one_epoch(compiled(build, per_execution), x, y),
    }
    if per_execution > 1:
        contenders["towers k=1"] = one_epoch(
            Towers(compiled(build, 1), devices=devices), x, y
        )
    times = interleaved(contenders, rounds=ROUNDS, steps_per_round=1, warmup=2)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # measured above

    def steps_per_second(name):
        return BATCHES / float(np.median(times[name]))

    name = f"{model_name}, k={per_execution}"
    versus_keras = ratio(times, "towers", "keras")
    RESULTS.append(
        {"name": f"{name}: towers / keras fit", **versus_keras, "target": None}
    )
    info = {
        "towers_steps_per_s": steps_per_second("towers"),
        "keras_steps_per_s": steps_per_second("keras"),
        "vs_keras": versus_keras,
    }
    if per_execution > 1:
        speedup = ratio(times, "towers", "towers k=1")
        RESULTS.append(
            {"name": f"{name}: towers / towers k=1", **speedup, "target": 1.0}
        )
        info["towers_k1_steps_per_s"] = steps_per_second("towers k=1")
        info["vs_k1"] = speedup
    benchmark.extra_info.update(info)
    print(
        f"\n{name}: towers {info['towers_steps_per_s']:.0f} steps/s, Keras' fit "
        f"{info['keras_steps_per_s']:.0f} steps/s"
        + (
            f", towers k=1 {info['towers_k1_steps_per_s']:.0f} steps/s"
            if per_execution > 1
            else ""
        )
    )

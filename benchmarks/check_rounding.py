"""The first-step check in float32 on real models (issue 76, item 1): no
alarm from rounding, and where the float64 twin is asked, how near one
device's the twin's step is. Run by hand (a few minutes a model):

    .venv/bin/python -m benchmarks.check_rounding [MobileNetV2 ResNet GPT2]

Each line: model, optimizer, towers, seed; whether the check refused; the
largest relative difference in float32; the twin's largest (or "-" where
float32 left no room for a mechanism of 0.1 % and no twin was asked); the
check's seconds. MobileNetV2 (alpha 0.35) and the small BatchNormalization
ResNet are ``tests/test_real_models.py``'s, at 32x32, batch 32; GPT2 its
tiny keras_hub config, 16 sequences of 8 tokens.
"""

from __future__ import annotations

import sys
import time

import keras
import numpy as np

import conftest  # noqa: F401 - the 8 logical CPUs, before TensorFlow starts
from tests.test_real_models import APPLICATIONS, CAUSAL_LMS
from towers import Towers

OPTIMIZERS = {"SGD": lambda: keras.optimizers.SGD(0.01), "Adam": lambda: "adam"}


def data(name: str, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    if name == "GPT2":
        tokens = rng.integers(1, 64, (16, 9))
        x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), bool)}
        return x, tokens[:, 1:]
    return rng.standard_normal((32, 32, 32, 3)).astype("float32"), rng.integers(
        0, 5, 32
    )


def model(name: str, optimizer: str) -> keras.Model:
    if name == "GPT2":
        built = CAUSAL_LMS["GPT2"]()
    else:
        built = APPLICATIONS[name](weights=None, input_shape=(32, 32, 3), classes=5)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name == "GPT2")
    built.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss)
    return built


def sweep(names: list[str], towers=(2, 8), seeds=(0, 1)) -> list[dict]:
    rows = []
    for name in names:
        for optimizer in OPTIMIZERS:
            for count in towers:
                for seed in seeds:
                    keras.utils.set_random_seed(seed)
                    engine = Towers(
                        model(name, optimizer),
                        devices=[f"/cpu:{i}" for i in range(count)],
                    )
                    x, y = data(name, seed)
                    start = time.perf_counter()
                    comparison = engine.check(x, y)
                    seconds = time.perf_counter() - start
                    own = [d.relative for d in comparison.differences if not d.reported]
                    twin = comparison.twin
                    row = dict(
                        model=name, optimizer=optimizer, towers=count, seed=seed,
                        refused=bool(comparison.differs), float32=max(own),
                        twin=None if twin is None else max(
                            d.relative for d in twin.differences if not d.reported
                        ),
                        seconds=seconds,
                    )  # fmt: skip
                    rows.append(row)
                    print(_line(row), flush=True)
                    if comparison.differs:
                        print(comparison, flush=True)
    return rows


def _line(row: dict) -> str:
    twin = "-" if row["twin"] is None else f"{row['twin']:.2g}"
    return (
        f"{row['model']:<12} {row['optimizer']:<5} {row['towers']} towers seed "
        f"{row['seed']}: {'REFUSED' if row['refused'] else 'passed '} float32 "
        f"{row['float32']:.2g}  twin {twin}  {row['seconds']:.1f} s"
    )


if __name__ == "__main__":
    sweep(sys.argv[1:] or ["MobileNetV2", "ResNet", "GPT2"])

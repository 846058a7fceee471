"""The first step of a model's own train_step: what the probe costs (issue 58).

Before the first training step towers runs the model's own ``train_step``
on two examples together and on each alone, nothing applied, to find how its
losses depend on the batch (``towers/step/rules/loss_kinds.py``). That is three more
traces of the step on one device. Each contender's first step in a fresh
process, in turns, from construction to the first loss read back, on the
guide's step (``bench_own_step_xla.GuideStep``, MLP preset, batch 256):

- ``keras``: Keras' own ``fit`` of one step on one device (the reference);
- ``towers``: ``Towers(model, devices=4 logical CPUs).fit`` of one step.

No target: ``towers / keras`` is reported with its spread.
"""

import json
import subprocess
import sys

from benchmarks.conftest import record_ratio
from towers.bench.timing import ratio

SCRIPT = """
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import towers
devices = towers.virtual_devices(4)
import numpy as np
from benchmarks.bench_own_step_xla import BATCH, GuideStep, mlp
rng = np.random.default_rng(0)
x = rng.standard_normal((BATCH, 784)).astype("float32")
y = rng.integers(0, 10, BATCH)
start = time.perf_counter()
model = mlp(GuideStep)
fit = model.fit if sys.argv[1] == "keras" else towers.Towers(model, devices=devices).fit
history = fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
float(history.history["loss"][0])
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def first_step(contender: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, contender],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def test_own_steps_first_step_against_keras_fit(benchmark):
    times = {"keras": [], "towers": []}
    for round_ in range(3):
        order = ["keras", "towers"] if round_ % 2 == 0 else ["towers", "keras"]
        for contender in order:
            times[contender].append(first_step(contender))
    record_ratio(
        benchmark,
        "own step's first step, 4 towers / Keras' fit",
        ratio(times, "towers", "keras"),
        None,
    )

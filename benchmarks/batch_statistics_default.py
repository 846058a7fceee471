"""What BatchNormalization's default (``batch_statistics="global"``, one
device's) costs against ``"tower"`` at 1, 4 and 8 towers: the bench's ResNet
preset (BatchNormalization after every convolution), global batch 64, SGD,
logical CPUs. Each contender in a fresh process, in turns, round by round:
its first step (construction to the first loss read back) and its steady
step (the median of 12 after 3). No target: the price, reported in
``docs/sync-cost.md``. Run: ``python benchmarks/batch_statistics_default.py``.
"""

import json
import statistics
import subprocess
import sys

ROUNDS = 5
SCRIPT = """
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import towers
count, batch_statistics = int(sys.argv[1]), sys.argv[2]
devices = towers.virtual_devices(8)[:count]
import keras, numpy as np, tensorflow as tf
from towers.bench.presets import get_preset
preset = get_preset("resnet")
x, y = (tf.constant(v) for v in preset.batch(64, 0))
start = time.perf_counter()
engine = towers.Towers(preset.build, preset.loss(), lambda: keras.optimizers.SGD(0.01),
                       devices=devices, batch_statistics=batch_statistics)
float(engine.train_step(x, y)["loss"])
first = time.perf_counter() - start
times = []
for _ in range(15):
    begin = time.perf_counter()
    float(engine.train_step(x, y)["loss"])
    times.append(time.perf_counter() - begin)
print(json.dumps({"first_s": first, "steady_ms": 1000 * float(np.median(times[3:]))}))
"""


def run(count: int, batch_statistics: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(count), batch_statistics],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    found: dict = {}
    for _ in range(ROUNDS):
        for count in (1, 4, 8):
            for batch_statistics in ("global", "tower"):
                found.setdefault((count, batch_statistics), []).append(
                    run(count, batch_statistics)
                )
    for (count, batch_statistics), runs in sorted(found.items()):
        line = [f"{count} towers, {batch_statistics}:"]
        for key in ("first_s", "steady_ms"):
            values = [r[key] for r in runs]
            line.append(
                f"{key} {statistics.median(values):.3g} "
                f"[{min(values):.3g}, {max(values):.3g}]"
            )
        print(" ".join(line))


if __name__ == "__main__":
    main()

"""The README's Python examples run as a newcomer would paste them: each in a
fresh process, the Keras one given the data it names (synthetic, 20 features
and 3 classes), in a scratch directory for its checkpoints."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
DATA = """
import numpy as np
_rng = np.random.default_rng(0)
x_train, x_val, x_test = (_rng.standard_normal((n, 20)).astype("float32")
                          for n in (96, 32, 32))
y_train, y_val, y_test = (_rng.integers(0, 3, n) for n in (96, 32, 32))
"""


def test_the_readme_has_its_two_examples():
    assert len(BLOCKS) == 2


@pytest.mark.parametrize("block", BLOCKS, ids=["keras", "low_level"])
def test_a_readme_example_runs(block, tmp_path):
    # The data goes after the lines that must come before TensorFlow starts.
    head, _, rest = block.partition("\nimport keras")
    script = f"{head}\n{DATA}\nimport keras{rest}\nprint('ran to the end')\n"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ran to the end" in result.stdout

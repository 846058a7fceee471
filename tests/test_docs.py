"""The docs and examples run: every ``>>>`` line in docs/ is checked by doctest in a
fresh process (as a reader would run it, so it can split the CPU itself), and every
script in examples/ runs to the end and checks its own result."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if ">>> " in p.read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(*args, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_the_walkthrough_and_guides_have_examples():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert "docs/how-towers-work.md" in names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_examples_run_and_print_what_the_doc_says(doc):
    result = run(
        "-m", "doctest", "-o", "NORMALIZE_WHITESPACE", "-o", "ELLIPSIS", str(doc)
    )

    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_there_is_an_example_per_tf1_pattern():
    assert [p.name for p in EXAMPLES] == [
        "cifar10_average_gradients.py",
        "combine_pairs.py",
        "multi_gpu_model.py",
        "split_uneven.py",
    ]


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_checks_itself(script):
    result = run(str(script))

    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "towers matches one device" in result.stdout

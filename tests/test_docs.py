"""The docs and examples run: every ``>>>`` line in docs/ is checked by doctest in a
fresh process (as a reader would run it, so it can split the CPU itself), and every
script in examples/ runs to the end and checks its own result."""

import inspect
import os
import pathlib
import subprocess
import sys

import pytest

import towers

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if ">>> " in p.read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(*args, timeout=300, env=None):
    env = env or {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
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
def test_example_runs_checks_itself_and_starts_quietly(script):
    # As a reader runs it: no TF_CPP_MIN_LOG_LEVEL of ours.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = run(str(script), env=env)

    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "towers matches one device" in result.stdout
    assert result.stderr == ""  # no oneDNN, absl, nor rendezvous lines


def test_an_example_keeps_tensorflows_start_up_lines_when_asked():
    result = run(str(ROOT / "examples" / "combine_pairs.py"), "--verbose")

    assert result.returncode == 0, result.stderr[-2000:]
    assert "oneDNN" in result.stderr


def test_make_docs_builds_the_reference_without_warnings(tmp_path):
    makefile = (ROOT / "Makefile").read_text()
    assert "docs/build_api.py" in makefile.split("\ndocs:")[1].split("\n\n")[0]

    result = run("docs/build_api.py", str(tmp_path))

    assert result.returncode == 0, result.stderr[-2000:]
    assert "docs: " not in result.stderr
    index = (tmp_path / "towers.html").read_text()
    for name in towers.__all__:
        assert f'id="{name}"' in index, name
    for term in ("tower", "variable device", "placement", "reducer", "worker"):
        assert f"<strong>{term}</strong>" in index, term
    engine = (tmp_path / "towers" / "engine.html").read_text()
    for method in ("train_step", "fit", "evaluate", "explain"):
        assert f'id="Towers.{method}"' in engine, method


def public_functions():
    """Every public name of ``towers`` and the public methods and properties of
    its classes."""
    for name in towers.__all__:
        obj = getattr(towers, name)
        yield name, obj
        if inspect.isclass(obj):
            # Inherited members too (Towers' fit comes from
            # towers.training.loop.Trainer), each as the class resolves it.
            members = {
                member
                for klass in obj.__mro__
                if klass.__module__.startswith("towers")
                for member in vars(klass)
            }
            for member in sorted(m for m in members if not m.startswith("_")):
                value = inspect.getattr_static(obj, member)
                if isinstance(value, property):
                    yield f"{name}.{member}", value.fget
                elif callable(value) or isinstance(value, classmethod):
                    yield f"{name}.{member}", getattr(obj, member)


def test_every_public_function_has_an_example_that_doctest_runs():
    import doctest

    finder = doctest.DocTestFinder(recurse=False)
    missing = [
        name
        for name, obj in public_functions()
        if not any(t.examples for t in finder.find(obj, name, globs={}))
    ]

    assert missing == []

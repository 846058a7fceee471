"""``make docs``: the API reference, generated from the docstrings by pdoc.

Usage: ``python docs/build_api.py [OUT]`` (default ``docs/api``). The index page is
``towers``'s own docstring, the public names and the glossary; each module gets a
page. pdoc's warnings (a name that does not resolve, a broken docstring) fail the
build.
"""

import os
import pathlib
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pdoc  # noqa: E402
import pdoc.render  # noqa: E402

import towers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = [
    # The front door and the two ideas a reader learns first.
    "towers",
    "towers.engine",
    "towers.split",
    "towers.combine",
    "towers.reducers",
    # A stage folder brings every module in it, each with its own page.
    "towers.step",  # the data path, in the order a batch takes it
    "towers.placement",  # where variables live, how gradients meet, the apply
    "towers.cluster",  # several processes
    "towers.training",  # around the step: fit, input, checkpoints, logs
    "towers.explain",
    "towers.devices",
    "towers.bench",
]


def build(out: pathlib.Path) -> list[str]:
    """Writes the reference to ``out``; returns pdoc's warnings."""
    for name in towers.__all__:
        getattr(towers, name)  # resolve the lazy public names for pdoc
    pdoc.render.configure(
        docformat="google",
        footer_text=f"towers {towers.__version__}",
        search=True,
        show_source=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=out)
    return [str(w.message) for w in caught]


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "api")
    problems = build(out)
    for problem in problems:
        print(f"docs: {problem}", file=sys.stderr)
    print(f"API reference: {out / 'index.html'} ({len(MODULES)} modules)")
    sys.exit(1 if problems else 0)

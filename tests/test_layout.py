"""The layout shows the data path (docs/architecture.md): a folder per stage whose
imports go one way, from the front door down; small modules; no import circle
(visible or hidden in a function); no module reaching into the engine's private
names."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "towers"
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every towers module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("towers"):
                found.add(node.module)
                # `from towers import _runtime` imports the module towers._runtime.
                found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("towers")}
    return found


def test_no_module_is_long_and_the_front_door_is_thin():
    lengths = {module_name(p): len(p.read_text().splitlines()) for p in MODULES}
    assert max(lengths.values()) <= 400, lengths
    assert lengths["towers.engine"] <= 300


def test_no_import_circle_even_through_local_imports():
    known = {module_name(p) for p in MODULES}
    graph = {module_name(p): imports_of(p) & known for p in MODULES}
    graph = {name: deps - {"towers"} for name, deps in graph.items()}

    def cycle_from(start, node, seen):
        for dep in graph.get(node, ()):
            if dep == start:
                return [node, dep]
            if dep not in seen:
                seen.add(dep)
                rest = cycle_from(start, dep, seen)
                if rest:
                    return [node, *rest]
        return None

    cycles = {name: cycle_from(name, name, set()) for name in graph}
    assert {k: v for k, v in cycles.items() if v} == {}
    assert not [p for p in MODULES if "TYPE_CHECKING" in p.read_text()]


# Stages, nearest the front door first: a module imports from its own stage or
# from stages below it, never above (the top level's building blocks are the
# floor: split, combine, reducers, devices, options, _keras, _runtime).
STAGES = [
    {"cli", "demo", "commands", "bench"},
    {"engine", "parts"},
    {"training", "explain"},
    {"step"},
    {"cluster"},
    {"placement"},
    {"split", "combine", "reducers", "devices", "options", "_keras", "_runtime"},
]


def stage_of(module: str) -> int:
    part = module.split(".")[1]
    return next(rank for rank, names in enumerate(STAGES) if part in names)


def test_the_top_level_is_a_dozen_modules_beside_the_stage_folders():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 12, modules
    assert folders == [
        "_keras", "bench", "cluster", "explain", "placement", "step", "training"
    ]  # fmt: skip
    named = {name for names in STAGES for name in names}
    assert {Path(m).stem for m in modules} - {"__init__"} | set(folders) == named


def test_imports_go_one_way_from_the_front_door_down():
    known = {module_name(p) for p in MODULES}
    upward = {
        module_name(p): sorted(
            dep
            for dep in imports_of(p) & known
            if dep != "towers" and stage_of(dep) < stage_of(module_name(p))
        )
        for p in MODULES
        if module_name(p) != "towers"
    }
    assert {name: deps for name, deps in upward.items() if deps} == {}


@pytest.mark.parametrize(
    "folder", ["step", "placement", "cluster", "training", "explain"]
)
def test_each_stage_says_what_it_does_and_may_import(folder):
    tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and "May import" in doc
    assert len(tree.body) == 1  # the docstring: importing a stage runs nothing
    assert (ROOT / "tests" / folder / "__init__.py").exists()  # tests mirror it


def test_the_rules_import_the_seats_and_no_step_that_uses_them():
    # The seat and its verbs, which hooks a model overrides, and each other.
    allowed = {"towers.step.run.seats", "towers.step.work.hooks", "towers.step.rules"}
    rooms = {"towers.step.run", "towers.step.work"}  # `from room import module`
    found = {
        module_name(p): sorted(
            dep
            for dep in imports_of(p)
            if dep.startswith("towers.step.")
            and dep not in rooms
            and not any(dep == a or dep.startswith(a + ".") for a in allowed)
        )
        for p in (PACKAGE / "step" / "rules").glob("*.py")
    }
    assert {name: deps for name, deps in found.items() if deps} == {}


@pytest.mark.parametrize(
    "module",
    [
        "training/loop",
        "training/checkpoint",
        "training/summaries",
        "explain/run",
        "explain/graph",
        "explain/report",
    ],
)
def test_the_engines_users_touch_no_private_name(module):
    text = (PACKAGE / f"{module}.py").read_text()
    assert not re.findall(r"engine\._\w+", text)


def test_bench_touches_no_private_name_of_the_engine():
    found = {
        p.name: re.findall(
            r"engine\._\w+|\.step\._\w+|\.placement\._\w+", p.read_text()
        )
        for p in (PACKAGE / "bench").glob("*.py")
    }
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_current_tower_is_the_packages_one_thread_local():
    # What a tower's thread holds is one object (towers/_keras/current.py).
    found = [module_name(p) for p in MODULES if "threading.local()" in p.read_text()]
    assert found == ["towers._keras.current"]


def test_a_gradient_rule_is_a_file_of_rules_listed_once():
    # A new rule is one file in step/rules/ and its entry in grad_rules.RULES.
    from towers.step.rules import grad_rules

    rules = PACKAGE / "step" / "rules"
    defining = sorted(
        p.stem for p in rules.glob("*.py") if "\ndef one_devices(" in p.read_text()
    )
    listed = [rule.__module__.rsplit(".", 1)[1] for rule in grad_rules.RULES]
    assert sorted(listed) == defining and len(set(listed)) == len(listed)

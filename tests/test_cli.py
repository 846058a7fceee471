import json
import re
import subprocess
import sys

import pytest

from towers.cli import build_parser, main


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "towers.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_devices_lists_physical_and_logical_with_kinds(capsys):
    assert main(["devices"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["level", "kind", "name"]
    assert ["physical", "CPU", "/physical_device:CPU:0"] in [
        line.split() for line in lines
    ]
    logical = [line.split()[2] for line in lines if line.startswith("logical")]
    assert logical == [f"/device:CPU:{i}" for i in range(8)]


def test_devices_virtual_split_after_initialisation_is_a_clear_error(capsys):
    assert main(["devices", "--virtual", "3"]) == 2

    assert "already initialised with 8 logical CPU" in capsys.readouterr().err


def test_devices_virtual_split_in_a_fresh_process():
    result = run_cli("devices", "--virtual", "3")

    assert result.returncode == 0, result.stderr
    logical = re.findall(r"^logical\s+CPU\s+(\S+)", result.stdout, re.M)
    assert logical == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


@pytest.mark.parametrize("command", [[], ["devices"], ["demo"], ["explain"]])
def test_every_command_has_help(command):
    result = run_cli(*command, "--help")

    assert result.returncode == 0
    assert result.stdout.startswith("usage: towers")
    assert len(result.stdout.splitlines()) > 5


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([])
    assert exit_info.value.code == 2


def test_demo_learns_the_digits_and_shows_placement_and_phases(tmp_path):
    result = run_cli("demo", "--log-dir", str(tmp_path), timeout=600)

    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert (
        "towers: 4 on /device:CPU:0, /device:CPU:1, /device:CPU:2, /device:CPU:3" in out
    )
    assert "splits as [16, 16, 16, 16]" in out
    accuracy = float(re.search(r"test accuracy: (\S+)", out)[1])
    assert accuracy >= 0.97
    # Placement, read from the graph TensorFlow placed (towers explain).
    assert re.search(r"^  \d+\.\d [KM]iB on /device:CPU:0$", out, re.M)
    row = re.search(r"^  tower 3 backward((?: +(?:\d+|\.)){4})$", out, re.M)[1]
    counts = [0 if c == "." else int(c) for c in row.split()]
    assert max(counts) == counts[3]  # tower 3's gradients ran on CPU:3
    assert "apply ran on         /device:CPU:0" in out
    phases = dict(re.findall(r"^  (.+?)\s{2,}(\d+\.\d+) ms$", out, re.M))
    assert sorted(phases) == sorted(
        [
            "the 4 towers' forward and backward passes",
            "combine: the towers' gradients summed",
            "apply: the optimizer's update, once",
            "the whole step, as fit runs it",
        ]
    )
    assert all(float(ms) > 0 for ms in phases.values())
    assert "they\n  overlap" in out or "they overlap" in out  # why they add up past it
    # What crossed, in words: weights from the variables, a tower's loss share.
    assert re.search(r"weights +variables -> tower 1 forward ", out)
    assert re.search(r"loss +tower 1 forward -> combine ", out)
    # Each phase is traced as the engine traces its step, without AutoGraph,
    # which cannot convert the step's code and says so on the way.
    assert "AutoGraph could not transform" not in result.stdout + result.stderr
    # TensorBoard gets the run's summaries and a trace of steps 10-12.
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))
    assert list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_explain_draws_the_demo_models_step(tmp_path):
    import matplotlib.image

    png, data = tmp_path / "step.png", tmp_path / "step.json"
    result = run_cli(
        "explain",
        "--towers",
        "2",
        "--batch",
        "10",
        "--png",
        str(png),
        "--json",
        str(data),
    )

    assert result.returncode == 0, result.stderr
    assert "shards of [5, 5] examples" in result.stdout
    assert re.search(
        r"sequential/conv2d/kernel\s+\(3, 3, 1, 32\).*CPU:0", result.stdout
    )
    assert matplotlib.image.imread(png).shape[0] > 300
    report = json.loads(data.read_text())
    assert list(report["ops"]["apply"]) == ["/device:CPU:0"]
    backward = report["ops"]["tower 1 backward"]
    assert max(backward, key=backward.get) == "/device:CPU:1"


def test_version_names_the_distribution_the_index_has_for_us(capsys):
    # The index's "towers" is another project; ours installs as tf-towers.
    import configparser
    import pathlib

    import towers

    setup = configparser.ConfigParser()
    setup.read(pathlib.Path(towers.__file__).parent.parent / "setup.cfg")
    assert setup["metadata"]["name"] == "tf-towers"
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tf-towers {towers.__version__}"


def test_docs_cli_names_every_flag_of_every_command():
    import argparse
    import pathlib

    page = (pathlib.Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    parser = build_parser()
    commands = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    missing = [
        f"{name} {flag}"
        for name, command in commands.choices.items()
        for action in command._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help" and flag not in page
    ]
    assert missing == []


def test_a_command_starts_quietly_unless_asked():
    def stderr(*flags):
        run = subprocess.run(
            [sys.executable, "-m", "towers.cli", *flags, "devices"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        return run.stderr

    quiet = stderr()
    assert "oneDNN" not in quiet and "absl" not in quiet
    assert "oneDNN" in stderr("--verbose")  # TensorFlow's own lines, when asked

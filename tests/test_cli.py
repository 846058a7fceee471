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


@pytest.mark.parametrize("command", [[], ["devices"], ["demo"]])
def test_every_command_has_help(command):
    result = run_cli(*command, "--help")

    assert result.returncode == 0
    assert result.stdout.startswith("usage: towers")
    assert len(result.stdout.splitlines()) > 5


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([])
    assert exit_info.value.code == 2


def test_demo_trains_and_matches_one_device():
    result = run_cli("demo", "--towers", "3", "--steps", "12", "--batch", "20")

    assert result.returncode == 0, result.stderr
    assert "towers: 3 on /device:CPU:0, /device:CPU:1, /device:CPU:2" in result.stdout
    assert "each step splits 20 examples as [7, 7, 6]" in result.stdout
    difference = float(re.search(r"largest weight difference (\S+)", result.stdout)[1])
    assert difference < 1e-5
    accuracy = float(
        re.search(r"accuracy on 1000 new examples: (\S+)", result.stdout)[1]
    )
    assert accuracy > 0.8

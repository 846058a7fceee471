"""towers bench's plan, device choice and scaling arithmetic (no processes)."""

import pytest

from towers.bench.presets import PRESETS
from towers.bench.run import (
    PRESET_NAMES,
    BenchOptions,
    _add_scaling,
    choose_devices,
    configurations,
    label,
    measure_spec,
)


def test_configurations_run_single_once_then_each_tower_count():
    options = BenchOptions(
        towers=[1, 2],
        reducers=["per_tensor", "packed"],
        placements=["cpu"],
        baselines=["single", "mirrored"],
    )
    names = [f"{label(c)} x{c['towers']}" for c in configurations(options)]
    assert names == [
        "single x1",
        "towers cpu per_tensor x1",
        "towers cpu packed x1",
        "mirrored x1",
        "towers cpu per_tensor x2",
        "towers cpu packed x2",
        "mirrored x2",
    ]


def test_without_gpus_the_cpu_is_split():
    names, virtual, note = choose_devices(4, num_gpus=0, virtual=False)
    assert names == [f"/device:CPU:{i}" for i in range(4)] and virtual == 4
    assert note == "4 logical CPUs split from one physical CPU"


def test_more_towers_than_gpus_needs_virtual():
    with pytest.raises(ValueError) as error:
        choose_devices(4, num_gpus=2, virtual=False)
    assert "up to 4 towers but this machine has 2 GPU(s)" in str(error.value)
    assert "--virtual" in str(error.value)
    names, virtual, _ = choose_devices(4, num_gpus=2, virtual=True)
    assert names[-1] == "/device:GPU:3" and virtual == 4
    assert choose_devices(2, num_gpus=2, virtual=False)[:2] == (
        ["/device:GPU:0", "/device:GPU:1"],
        None,
    )


def test_speedup_and_efficiency_are_against_the_same_contender_at_one_tower():
    records = [
        {
            "contender": "mirrored",
            "towers": 1,
            "status": "ok",
            "examples_per_second": 100,
        },
        {
            "contender": "mirrored",
            "towers": 4,
            "status": "ok",
            "examples_per_second": 300,
        },
        {
            "contender": "single",
            "towers": 1,
            "status": "ok",
            "examples_per_second": 120,
        },
        {"contender": "mirrored", "towers": 8, "status": "timed out"},
    ]
    _add_scaling(records)
    assert records[1]["speedup"] == pytest.approx(3.0)
    assert records[1]["efficiency"] == pytest.approx(0.75)
    assert records[2]["speedup"] == pytest.approx(1.0)
    assert "speedup" not in records[3]


def test_the_cli_knows_every_preset():
    assert tuple(PRESETS) == PRESET_NAMES


def test_a_process_splits_the_kind_of_device_its_towers_use():
    config = {
        "contender": "towers",
        "towers": 2,
        "placement": "tower0",
        "reducer": "packed",
    }
    gpus = ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
    spec = measure_spec(config, BenchOptions(), gpus, virtual=3)
    assert (spec["kind"], spec["virtual"], spec["devices"]) == ("GPU", 3, gpus[:2])
    assert (spec["placement"], spec["variable_device"]) == ("central", "/device:GPU:0")
    cpus = ["/device:CPU:0", "/device:CPU:1"]
    spec = measure_spec({**config, "placement": "cpu"}, BenchOptions(), cpus, 2)
    assert (spec["kind"], spec["variable_device"]) == ("CPU", "/cpu:0")

import keras
import pytest
import tensorflow as tf

import towers
from towers.devices import canonical_device, describe_devices, resolve_devices


def test_virtual_devices_returns_the_logical_cpus_made_by_conftest():
    names = towers.virtual_devices(8)

    assert names == [f"/device:CPU:{i}" for i in range(8)]
    assert names == [d.name for d in tf.config.list_logical_devices("CPU")]


def test_virtual_devices_after_initialisation_with_other_count_raises():
    with pytest.raises(RuntimeError, match=r"already initialised with 8 logical CPU"):
        towers.virtual_devices(4)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_virtual_devices_rejects_non_positive_int(bad):
    with pytest.raises(ValueError, match=r"n must be a positive int; received"):
        towers.virtual_devices(bad)


def test_virtual_devices_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"kind must be one of \['CPU', 'GPU'\]"):
        towers.virtual_devices(2, kind="TPU")


@pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")), reason="this machine has a GPU"
)
def test_virtual_devices_without_gpu_names_what_exists():
    with pytest.raises(ValueError, match=r"no physical GPU device.*CPU:0"):
        towers.virtual_devices(2, kind="GPU")


@pytest.mark.parametrize(
    "given, expected",
    [
        ("/cpu:0", "/device:CPU:0"),
        ("CPU:3", "/device:CPU:3"),
        ("/device:CPU:7", "/device:CPU:7"),
        ("/job:localhost/replica:0/task:0/device:CPU:2", "/device:CPU:2"),
        ("/cpu", "/device:CPU:0"),
    ],
)
def test_canonical_device_accepts_every_spelling(given, expected):
    assert canonical_device(given) == expected


def test_resolve_devices_default_is_the_cpu_without_gpus():
    expected = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        "/device:CPU:0"
    ]

    assert resolve_devices(None) == expected


def test_resolve_devices_unknown_device_names_it_and_lists_available():
    with pytest.raises(ValueError) as error:
        resolve_devices(["/cpu:0", "/gpu:7"])

    message = str(error.value)
    assert "received '/gpu:7'" in message
    assert "available: ['/device:CPU:0'" in message


def test_an_unknown_variable_device_is_named_as_variable_device():
    with pytest.raises(ValueError) as error:
        towers.Towers(
            lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
            "mse",
            "sgd",
            devices=["/cpu:0", "/cpu:1"],
            variable_device="/cpu:99",
        )

    message = str(error.value)
    assert message.startswith("variable_device must exist; received '/cpu:99'")
    assert "available: ['/device:CPU:0'" in message


def test_resolve_devices_empty_list_raises():
    with pytest.raises(ValueError, match=r"at least one device; received devices=\[\]"):
        resolve_devices([])


def test_resolve_devices_duplicate_names_both_spellings():
    with pytest.raises(ValueError, match=r"received '/cpu:1' and 'CPU:1'"):
        resolve_devices(["CPU:1", "/cpu:1"])


def test_resolve_devices_string_instead_of_list_raises():
    with pytest.raises(ValueError, match=r"list of device names; received the string"):
        resolve_devices("/cpu:0")


def test_resolve_devices_garbage_name_raises():
    with pytest.raises(ValueError, match=r"received 'not a device'"):
        resolve_devices(["not a device"])


def test_describe_devices_lists_physical_and_logical():
    rows = describe_devices()

    physical = [r for r in rows if r["level"] == "physical"]
    logical = [r for r in rows if r["level"] == "logical"]
    assert {r["kind"] for r in physical} >= {"CPU"}
    assert [r["name"] for r in logical if r["kind"] == "CPU"] == [
        f"/device:CPU:{i}" for i in range(8)
    ]

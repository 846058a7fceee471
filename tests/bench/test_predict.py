"""The cost model: its formulas by hand, and how close it gets to published runs."""

import pytest

from towers.bench.predict import (
    TOPOLOGIES,
    predict,
    published_checks,
    sync_ms,
)


def test_parameter_device_is_limited_by_the_link_or_the_host():
    pcie = TOPOLOGIES["pcie-cpu"]  # 12 GB/s per link, 48 GB/s host
    # 1.2 GB each way: 2.4 GB over one 12 GB/s link = 200 ms.
    assert sync_ms(1.2e9, 2, pcie) == pytest.approx(200.0)
    # 8 towers: the host carries 2 * 8 * 1.2 GB = 19.2 GB at 48 GB/s = 400 ms.
    assert sync_ms(1.2e9, 8, pcie) == pytest.approx(400.0)


def test_ring_moves_2s_n_minus_1_over_n_per_member():
    ring = TOPOLOGIES["nvlink-ring"]  # 18 GB/s
    assert sync_ms(1.8e9, 1, ring) == 0.0
    assert sync_ms(1.8e9, 4, ring) == pytest.approx(1e3 * 2 * 1.8 * 3 / 4 / 18)


def test_bounds_bracket_and_efficiency_is_against_one_tower():
    (one, four) = predict(1.2e9, 100.0, 32, [1, 4], TOPOLOGIES["pcie-cpu"])
    assert four["step_ms_no_overlap"] == pytest.approx(100.0 + 200.0)
    assert four["step_ms_full_overlap"] == pytest.approx(200.0)
    assert four["examples_per_second_no_overlap"] == pytest.approx(4 * 32 / 0.3)
    assert four["efficiency_no_overlap"] == pytest.approx(
        one["step_ms_no_overlap"] / 300
    )


def test_resnet50_on_p100s_within_5_percent_of_published():
    rows = published_checks()["resnet50_p100"]
    errors = {row["towers"]: round(row["error_no_overlap"], 3) for row in rows}
    # 1 GPU is the calibration point (exact by construction); 2/4/8 are predictions.
    assert errors[1] == 0.0
    assert all(abs(e) <= 0.05 for e in errors.values()), errors
    # The published runs lie between the no-overlap and full-overlap bounds at 8.
    eight = rows[-1]
    assert (
        eight["examples_per_second_no_overlap"]
        <= eight["published"]
        <= eight["examples_per_second_full_overlap"]
    )


def test_horovod_128_gpus_brackets_the_published_88_to_90_percent():
    for row in published_checks()["horovod_128"]:
        # Without overlap the model is the lower bound: below 88 %, within 6 points.
        assert 0.82 <= row["efficiency_no_overlap"] <= 0.90, row

"""`towers bench`'s table as a reader sees it: whole words at any width, the
columns a run fills, and a legend for what each ratio is against."""

import pytest

from towers.bench.report import legend, tables


def record(contender, towers, xla=False, **fields):
    r = {
        "contender": contender, "towers": towers, "status": "ok", "step_ms": 4.98,
        "single_device_ms": 3.71, "vs_single_device": 1.34,
        "vs_single_device_q25": 1.31, "vs_single_device_q75": 1.38,
        "examples_per_second": 12860.0, "speedup": 1.0, "efficiency": 1.0,
        "jit_compile": xla,
    }  # fmt: skip
    if towers > 1:
        r.update(vs_floor=1.22, vs_floor_q25=1.17, vs_floor_q75=1.29)
    if xla:
        r.update(
            vs_single_device_xla=1.1, vs_single_device_xla_q25=1.0,
            vs_single_device_xla_q75=1.2,
        )  # fmt: skip
    if contender == "towers":
        r.update(
            placement="balanced", reducer="bf16+per_tensor", bytes_per_tower=2.68e6,
            phases_ms={"compute": 3.5, "combine": 0.75, "apply": 2.0},
            algbw_gbps=3.56, busbw_gbps=1.78,
        )  # fmt: skip
    r.update(fields)
    return r


def result(*records):
    return {"preset": "mlp", "batch": 64, "device_note": "2 logical CPUs",
            "records": list(records)}  # fmt: skip


RUN = result(
    record("single", 1), record("towers", 1), record("central_storage", 1),
    record("towers", 2), record("mirrored", 2),
    {"contender": "naive", "towers": 2, "status": "failed: ValueError: no GPU"},
)  # fmt: skip


@pytest.mark.parametrize("width", [60, 80, 200])
def test_the_table_fits_the_width_and_clips_nothing(width):
    lines = tables(RUN, width) + legend(RUN, width)

    assert max(map(len, lines)) <= width
    text = "\n".join(lines)
    assert "…" not in text
    assert "towers balanced bf16+per_tensor" in text and "central_storage" in text
    assert "1.34 [1.31-1.38]" in text and "1.22 [1.17-1.29]" in text
    # Every measured value is somewhere, whatever the bands.
    for header in [
        "step ms",
        "1 dev ms",
        "vs floor",
        "eff",
        "combine ms",
        "busbw GB/s",
    ]:
        assert header in text, header


def test_a_column_no_row_fills_is_left_out_and_its_legend_too():
    text = "\n".join(tables(RUN) + legend(RUN))
    assert "xla" not in text

    with_xla = result(record("single", 1, xla=True), record("towers", 2, xla=True))
    text = "\n".join(tables(with_xla) + legend(with_xla))
    assert "vs 1 dev xla" in text and "1.10 [1.00-1.20]" in text


def test_the_legend_says_what_each_ratio_is_against_and_why_a_row_is_empty():
    said = " ".join(legend(RUN, 100))
    assert "vs 1 dev: step ms / 1 dev ms" in said
    assert "vs floor: against the zero-sync floor" in said
    assert "speedup: examples/s over the same contender's at 1 tower" in said
    assert "naive x2: failed: ValueError: no GPU" in said
    row = next(line for line in tables(RUN, 200) if line.startswith("naive"))
    assert set(row.split()[2:]) == {"-"}

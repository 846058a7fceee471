"""Prints every measured ratio against its target at the end of `make bench`.

Each ratio is printed with the interquartile range of its rounds' ratios: a
target inside that range is "within noise", neither met nor missed.
"""

RESULTS: list[dict] = []


def record_ratio(
    benchmark, name: str, result: dict, target: float | None, step=None, **info
):
    """Reports a measured ratio against its target (None: a comparison with no
    target); with ``step``, then times ``step`` alone (once per test).

    ``result`` comes from ``towers.bench.timing.ratio``; it goes to
    pytest-benchmark's ``extra_info`` (with ``info``) and to the summary printed
    at the end.
    """
    benchmark.extra_info[name] = {**result, **info}
    RESULTS.append({"name": name, **result, "target": target})
    if step is not None:
        benchmark.pedantic(lambda: _read(step()), rounds=30, warmup_rounds=3)


def _read(result):
    """A step's result read back, so the timed work really ran."""
    if isinstance(result, dict):
        result = result["loss"]
    return result.numpy()


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("ratios measured in this run (lower is better)")
    for row in RESULTS:
        verdict = _verdict(row)
        terminalreporter.write_line(
            f"{row['name']:<44} {row['contender_ms']:8.3f} ms vs "
            f"{row['baseline_ms']:8.3f} ms  ratio {row['ratio']:.3f} "
            f"[{row['ratio_q25']:.3f}, {row['ratio_q75']:.3f}]  "
            + (f"target <= {row['target']:.2f}  " if row["target"] else "")
            + verdict
        )


def _verdict(row: dict) -> str:
    """Meets, misses, or can't tell: the target lies inside the rounds' spread."""
    if row["target"] is None:
        return "(compared, no target)"
    if row["ratio"] <= row["target"]:
        return "meets"
    if row["ratio_q25"] <= row["target"]:
        return "within noise"
    if row.get("floor_ratio", 0.0) > row["target"]:
        # Measured in the same run: the CPU the step needs, over the cores.
        floor = row["floor_ratio"]
        return f"MISSES (out of reach on this machine: CPU floor {floor:.2f})"
    return "MISSES"

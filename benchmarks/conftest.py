"""Prints every measured ratio against its target at the end of `make bench`."""

RESULTS: list[dict] = []


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("ratios measured in this run (lower is better)")
    for row in RESULTS:
        verdict = "meets" if row["ratio"] <= row["target"] else "MISSES"
        terminalreporter.write_line(
            f"{row['name']:<44} {row['contender_ms']:8.3f} ms vs "
            f"{row['baseline_ms']:8.3f} ms  ratio {row['ratio']:.3f}  "
            f"target <= {row['target']:.2f}  {verdict}"
        )

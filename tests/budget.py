"""The per-test time budget (tests/README.md), reported at the end of every run.

A test's call phase should take at most FAST_BUDGET_S, or SLOW_BUDGET_S if it is marked
slow; a fixture's setup (a server start, a model load) at most SLOW_BUDGET_S, paid once per
scope it is shared in. The end of the run lists what went over, slowest first. It prints and
never fails: times depend on the machine and on what else runs on it, so a hard limit would
make the suite flaky; the list is what a reviewer reads beside `--durations=25`.

tests/conftest.py imports the two hooks below, which pytest finds there by name. Under
pytest-xdist the workers' reports reach the controller's pytest_runtest_logreport too.
"""

from __future__ import annotations

FAST_BUDGET_S = 2.0
"""Seconds a test not marked slow may take (its call phase)."""
SLOW_BUDGET_S = 30.0
"""Seconds a slow test's call phase, or any fixture setup, may take."""

_over: list[tuple[float, str, str]] = []  # (seconds, phase, nodeid)


def budget_of(phase: str, slow: bool) -> float:
    """The budget of one phase of a test's report."""
    return FAST_BUDGET_S if phase == "call" and not slow else SLOW_BUDGET_S


def pytest_runtest_logreport(report) -> None:
    if report.when == "teardown" or report.skipped:
        return
    if report.duration > budget_of(report.when, "slow" in report.keywords):
        _over.append((report.duration, report.when, report.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _over:
        return
    terminalreporter.section("over the per-test budget (tests/README.md)")
    terminalreporter.write_line(
        f"budget: a test {FAST_BUDGET_S:g} s, a slow test or a fixture's setup "
        f"{SLOW_BUDGET_S:g} s")
    for seconds, phase, nodeid in sorted(_over, reverse=True):
        terminalreporter.write_line(f"{seconds:8.2f}s {phase:<5} {nodeid}")

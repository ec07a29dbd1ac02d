"""tests/second_lane.py on a suite of its own (a temporary folder wired as tests/conftest.py
wires it): the lane module's tests run in another process at the lowest CPU priority, and
the main process reports them as its own: in the summary, the JUnit file and the exit
status, a failure included; and the lane stays in the main process's session."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,  # (two pytest processes)
              pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling")]

CONFTEST = """
from tests import second_lane

def pytest_configure(config):
    second_lane.configure(config)

def pytest_collection_modifyitems(config, items):
    second_lane.start(config, items)

def pytest_runtest_protocol(item, nextitem):
    return second_lane.run_or_replay(item)

def pytest_runtest_logreport(report):
    second_lane.write_report(report)

def pytest_unconfigure(config):
    second_lane.stop(config)
"""
LANE_TESTS = """
import os

def test_runs_in_the_lane():
    with open(os.path.join(os.environ["PROBE"], "lane.txt"), "w") as probe:
        probe.write(f"{os.getpid()} {os.getsid(0)}")
    assert os.sched_getscheduler(0) == os.SCHED_IDLE

def test_fails_in_the_lane():
    assert 1 + 1 == 3, "a lane failure"
"""
MAIN_TESTS = """
import os

def test_runs_here():
    with open(os.path.join(os.environ["PROBE"], "main.txt"), "w") as probe:
        probe.write(f"{os.getpid()} {os.getsid(0)}")
    assert os.sched_getscheduler(0) != os.SCHED_IDLE
"""


def test_the_lane_runs_its_module_at_idle_priority_and_reports_to_the_main_process(
        tmp_path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_lane.py").write_text(LANE_TESTS)
    (tmp_path / "test_main.py").write_text(MAIN_TESTS)
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PAGODA_TEST_LANE_MODULES": "test_lane.py", "PROBE": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    env.pop("PAGODA_TEST_LANE", None)
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rA", f"--junitxml={junit}",
                          "test_main.py", "test_lane.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED test_lane.py::test_fails_in_the_lane - AssertionError: a lane failure" \
        in run.stdout
    assert "2 passed, 1 failed" in run.stdout or "1 failed, 2 passed" in run.stdout
    cases = {case.get("name"): case for case in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) == {"test_runs_here", "test_runs_in_the_lane", "test_fails_in_the_lane"}
    assert cases["test_fails_in_the_lane"].find("failure") is not None
    lane_pid, lane_session = (tmp_path / "lane.txt").read_text().split()
    main_pid, main_session = (tmp_path / "main.txt").read_text().split()
    assert lane_pid != main_pid
    assert lane_session == main_session  # (a session of its own escapes SCHED_IDLE)

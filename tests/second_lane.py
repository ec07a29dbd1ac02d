"""A second lane for the suite: the CPU-bound tests that time nothing run in a pytest process
of their own, at the lowest CPU priority, beside the rest.

Why: the suite keeps its two cores about two-thirds busy (servers wait on their clients,
clients on servers), and pytest-xdist measured slower here (tests/README.md): two workers at
the same priority double the shared servers and models and spin against each other's
thread pools, and timing tests fail under the contention. The lane instead takes only
modules that need nothing shared and measure no time (LANE_MODULES: kernel builds and
their runs, converted-file checks, per-CPU-kind paths), and runs them under SCHED_IDLE, so
they use only the CPU the main lane leaves idle and never slow it.

How: the main process starts the lane once it has collected (`start`), with the lane's node
ids, and moves those items to the end of its own order. The lane writes every report it
makes (setup, call, teardown) to a file as pytest serializes them for xdist; when the main
process reaches a lane item it waits for that item's reports and logs them as its own
(`run_or_replay`), so the terminal, --durations, JUnit, the budget report and the exit
status see one suite. An item the lane did not report (the lane died, or could not collect
it) runs in the main process as usual. PAGODA_TEST_LANE=off runs everything in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

LANE_MODULES = (
    "tests/executor/test_cpu_kernels.py", "tests/executor/test_kernel_emulation.py",
    "tests/executor/test_kernels_aarch64.py", "tests/executor/test_gguf_packed.py",
    "tests/executor/test_lora_kernel.py", "tests/executor/test_llama_cpp_files.py",
    "tests/executor/test_cpu_kinds.py", "tests/executor/test_fidelity.py",
    "tests/executor/test_tensor_parallel.py", "tests/executor/test_compile.py",
    "tests/executor/test_gguf_yarn.py", "tests/executor/test_moe_kernel.py",
    "tests/bench/test_synthetic_gguf.py",
)
"""Modules the lane may take: CPU-bound, timing nothing, sharing no session server or
engine (a module added here must stay so)."""
TIMED_FIRST = ("tests/ab/", "tests/bench/", "tests/executor/test_arithmetic.py",
               "tests/deploy/test_ray_serve_cluster.py", "tests/entrypoints/test_server_guards.py",
               "tests/entrypoints/test_server_lifecycle.py")
"""Modules (or folders) whose verdicts or deadlines depend on speed: the main process runs
them first, and starts the lane only after them. (Measured: with kernel builds beside them
in a session of their own, where SCHED_IDLE does not hold (`lowest_priority`), the A/B and
bench suites took 11 minutes instead of 3, and a verdict failed. At the lowest priority a
lane still shares the caches and the memory bandwidth: the timed modules run alone.)"""
LANE_MODULES_ENV = "PAGODA_TEST_LANE_MODULES"
"""Comma-separated module paths (as node ids start) to take instead of LANE_MODULES."""
LANE_ENV = "PAGODA_TEST_LANE"
"""In the lane: the file its reports go to. In the main process: "off" for no lane."""
POLL_S = 0.2


class Lane:
    """The lane process (once started) and what it has reported so far, by node id."""

    def __init__(self, nodeids: list[str]) -> None:
        self.nodeids = set(nodeids)
        self._ordered = nodeids
        folder = Path(tempfile.mkdtemp(prefix="pagoda-test-lane-"))
        self.report_path, self.log_path = folder / "reports.jsonl", folder / "lane.log"
        self.reports: dict[str, list[dict]] = {}
        self._offset = 0
        self.process: subprocess.Popen | None = None
        self.replayed = 0

    def start(self) -> None:
        env = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}
        with open(self.log_path, "w") as log:  # (the lane's own terminal output)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self._ordered],
                env={**env, LANE_ENV: str(self.report_path)}, stdout=log,
                stderr=subprocess.STDOUT, process_group=0)  # (see `lowest_priority`)

    def _read(self) -> None:
        if not self.report_path.exists():
            return
        with open(self.report_path) as file:
            file.seek(self._offset)
            while (line := file.readline()).endswith("\n"):
                self._offset = file.tell()
                data = json.loads(line)
                self.reports.setdefault(data["nodeid"], []).append(data)

    def finished_reports(self, nodeid: str) -> list[dict] | None:
        """Its reports once its teardown is reported; None where the lane ended without."""
        while True:
            self._read()
            reports = self.reports.get(nodeid, [])
            if any(report["when"] == "teardown" for report in reports):
                return reports
            if self.process.poll() is not None:
                self._read()
                reports = self.reports.get(nodeid, [])
                done = any(report["when"] == "teardown" for report in reports)
                return reports if done else None
            time.sleep(POLL_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def is_lane() -> bool:
    return os.environ.get(LANE_ENV, "off") != "off"


def lowest_priority() -> None:
    """This process and those it starts run only where a core is otherwise idle (the lane
    calls it as it starts). Only within its session: where the kernel groups processes by
    session (sched_autogroup, on by default), a process started in a session of its own
    gets a fair share against the main one whatever its policy (measured: the lane took
    more CPU than the main process), so the lane and its builds are started in a process
    group of their own (to be stopped together) but in the main process's session."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        os.nice(19)


def in_lane(item: pytest.Item) -> bool:
    modules = os.environ.get(LANE_MODULES_ENV)
    return item.nodeid.split("::", 1)[0] in (modules.split(",") if modules else LANE_MODULES)


def timed(item: pytest.Item) -> bool:
    return item.nodeid.startswith(TIMED_FIRST)


def start(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest_collection_modifyitems, in the main process: where the lane's items have
    others beside them, order the timed modules first, the others next and the lane's last
    (each module's items kept together, in their order), and hand the lane's to a lane that
    starts after the timed ones (`run_or_replay`)."""
    if os.environ.get(LANE_ENV) or config.option.collectonly:
        return
    lane_items = [item for item in items if in_lane(item)]
    if not lane_items or len(lane_items) == len(items):
        return
    config.stash[LANE_KEY] = Lane([item.nodeid for item in lane_items])
    rest = [item for item in items if not in_lane(item)]
    items[:] = ([item for item in rest if timed(item)] + [item for item in rest if not timed(item)]
                + lane_items)


LANE_KEY = pytest.StashKey[Lane]()


def delegated(item: pytest.Item) -> bool:
    """Whether the lane process runs `item` (the main process only replays it)."""
    return LANE_KEY in item.config.stash and item.nodeid in item.config.stash[LANE_KEY].nodeids


def run_or_replay(item: pytest.Item) -> bool | None:
    """pytest_runtest_protocol: a delegated item's reports, logged as if run here; None
    (pytest runs it here) for any other item, or one the lane never finished."""
    if LANE_KEY not in item.config.stash:
        return None
    lane = item.config.stash[LANE_KEY]
    if lane.process is None and not timed(item):
        lane.start()  # the timed modules are behind
    if item.nodeid not in lane.nodeids:
        return None
    reports = lane.finished_reports(item.nodeid)
    if reports is None:
        return None
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for data in reports:
        report = hook.pytest_report_from_serializable(config=item.config, data=data)
        hook.pytest_runtest_logreport(report=report)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    lane.replayed += 1
    if lane.replayed == len(lane.nodeids):  # its last: let it finish (its own checks ran)
        lane.process.wait(timeout=300)
    return True


_lane_config: list[pytest.Config] = []  # in the lane: its config (for the serializer hook)


def configure(config: pytest.Config) -> None:
    """pytest_configure: in the lane, the lowest priority and its report writer."""
    if is_lane():
        lowest_priority()
        _lane_config.append(config)


def write_report(report: pytest.TestReport) -> None:
    """In the lane: one report, appended whole (one line) to the main process's file."""
    if not _lane_config:
        return
    config = _lane_config[0]
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(os.environ[LANE_ENV], "a") as file:
        file.write(json.dumps(data) + "\n")


def stop(config: pytest.Config) -> None:
    if LANE_KEY in config.stash:
        config.stash[LANE_KEY].stop()

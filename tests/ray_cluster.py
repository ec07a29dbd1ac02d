"""Helpers of the Ray backend's tests (the two-node cluster fixture is in conftest.py)."""

from __future__ import annotations

import time


def wait_for_free_cpus(ray, count: int, timeout: float = 15.0) -> float:
    """The cluster's free CPUs once `count` are free again, or after `timeout` (Ray frees
    actors and placement groups asynchronously)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) != count and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)

"""Processes started by the tests, read from /proc: for checking that no worker, replica,
server or Ray process outlives the test that started it.

Descendants are found by parent links; orphans (reparented to init when their parent died)
by an environment variable the session sets and every process it starts inherits
(`tagged_pids`)."""

from __future__ import annotations

import os
import time


def descendant_pids(root: int | None = None, command_part: bytes = b"") -> set[int]:
    """Live (not zombie) descendants of `root` (default: this process) whose command line
    contains `command_part`."""
    root = os.getpid() if root is None else root
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                commands[int(entry)] = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {pid for pid in found if command_part in commands.get(pid, b"")}


SESSION_TAG = "PAGODA_TEST_SESSION"
"""Environment variable conftest.py sets for the session: its value marks its processes."""


def tagged_pids(value: str) -> dict[int, bytes]:
    """Live processes other than this one whose environment holds SESSION_TAG=`value`:
    pid -> command line."""
    marker, found = f"{SESSION_TAG}={value}".encode(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environment = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if marker in environment and is_alive(int(entry)):
            found[int(entry)] = command
    return found


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(command_part: bytes = b"", timeout: float = 15.0) -> set[int]:
    """Wait (up to `timeout` s) for such descendants to end; returns those still alive."""
    deadline = time.monotonic() + timeout
    while (alive := descendant_pids(command_part=command_part)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive

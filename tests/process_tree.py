"""This test process's live descendants, read from /proc: for checking that no worker,
replica or Ray process outlives the test that started it."""

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

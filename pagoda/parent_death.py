"""A child process that must not outlive the process that started it (tensor-parallel
workers, data-parallel replicas) asks the kernel for a signal when its parent dies."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(death_signal: signal.Signals, parent_pid: int | None = None) -> None:
    """Linux: this process gets `death_signal` when its parent dies (PR_SET_PDEATHSIG;
    elsewhere a no-op). With `parent_pid`, exit at once if the parent already died before
    the request took effect (we were re-parented)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)

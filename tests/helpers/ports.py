"""The one way the tests pick a port: a free loopback port, chosen by the OS."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. (Another process may take it
    before the caller binds it; the OS hands out ports in rotation, so that is rare.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

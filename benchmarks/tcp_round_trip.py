"""The floor under a 2-rank all-reduce on one machine: a round trip of a message each way over
TCP loopback between two processes, plain sockets, no gloo (benchmarks/allreduce_cost.py
reports it beside gloo's all-reduce)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of values, the nearest rank (no interpolation)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _echo_server(listener: socket.socket, num_bytes: int, count: int) -> None:
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(count):
        received = 0
        while received < num_bytes:
            received += len(connection.recv(num_bytes - received))
        connection.sendall(b"\0" * num_bytes)
    connection.close()


def measure_tcp_round_trip(num_bytes: int, count: int = 2000) -> dict:
    """Round trip of num_bytes each way over TCP loopback between two processes: the floor
    under a 2-rank all-reduce of that size here (one exchange), without gloo's threads."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    server = mp.get_context("fork").Process(target=_echo_server, args=(listener, num_bytes, count))
    server.start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"\1" * num_bytes
    times_us = []
    for _ in range(count):
        start = time.perf_counter_ns()
        client.sendall(payload)
        received = 0
        while received < num_bytes:
            received += len(client.recv(num_bytes - received))
        times_us.append((time.perf_counter_ns() - start) / 1e3)
    client.close()
    server.join()
    listener.close()
    times_us = times_us[count // 10:]  # the first tenth is warm-up
    return {"bytes": num_bytes, "count": len(times_us), "median_us": statistics.median(times_us),
            "p90_us": percentile(times_us, 90), "mean_us": statistics.fmean(times_us)}

"""`pagoda serve --data-parallel-size 2 --distributed-executor-backend ray` on a two-node
Ray cluster on this machine: the replicas are Ray actors, one per node (each node has one
CPU, a replica reserves one); concurrent greedy requests all equal the offline engine's
answers, both replicas serve, and SIGTERM releases the actors."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pagoda import SamplingParams
from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer
from tests.ray_cluster import wait_for_free_cpus

ray = pytest.importorskip("ray", reason="make test installs Ray (the [ray] extra)")
pytestmark = pytest.mark.slow

PROMPTS = [f"Write one sentence about the number {n}." for n in range(8)]


async def complete_all(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": p, "max_tokens": 12, "temperature": 0})
            for p in PROMPTS))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


def generated(server: RemoteServer) -> list[float]:
    return [server.metric("generation_tokens_total", f'replica="{i}"') for i in (0, 1)]


def test_data_parallel_replicas_as_ray_actors(two_node_cluster, bundled_llm) -> None:
    offline = bundled_llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    server = RemoteServer(["--data-parallel-size", "2", "--distributed-executor-backend", "ray"],
                          env={"RAY_ADDRESS": two_node_cluster.address})
    try:
        assert wait_for_free_cpus(ray, 0) == 0  # both nodes' CPUs hold a replica
        texts = asyncio.run(complete_all(server.url))
        assert texts == [o.outputs[0].text for o in offline]
        deadline = time.monotonic() + 10  # (replicas ship their counters every 0.25 s)
        while time.monotonic() < deadline and not all(generated(server)):
            time.sleep(0.2)
        assert all(generated(server))  # both replicas served
    finally:
        assert server.stop() == 0
    assert wait_for_free_cpus(ray, 2) == 2  # the actors ended with the server

"""`pagoda serve --data-parallel-size 2`: two engine replica processes behind one server.

One server for the module; the tests run in order: 32 concurrent greedy streams equal the
offline engine's answers and both replicas serve; a repeated long prefix stays on one
replica (its prefix-cache hits); a replica killed with SIGKILL fails its own streams (an
SSE error event, no hang) while the other's finish, /health stays 200, and it restarts and
serves again; SIGTERM stops the server and every process it started. A last test kills a
server-like parent with SIGKILL: its replica dies with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from pagoda import SamplingParams
from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

NUM_REPLICAS = 2


# ---- processes (/proc, Linux) ---------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields after "pid (comm)": state, ppid, ...


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def replica_pids(server: RemoteServer) -> set[int]:
    pids = set()
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"data_parallel.replica_main" in f.read() and alive(pid):
                    pids.add(pid)
        except OSError:
            pass
    return pids


def wait_gone(pids: set[int], timeout: float = 20.0) -> set[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


# ---- helpers --------------------------------------------------------------------------------

def wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def per_replica(server: RemoteServer, name: str) -> list[float]:
    return [server.metric(name, f'replica="{i}"') for i in range(NUM_REPLICAS)]


def complete(server: RemoteServer, prompt: str, max_tokens: int = 4) -> dict:
    response = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                            first_chunk: asyncio.Event | None = None) -> tuple[str, dict | None]:
    """(text, the SSE error event's error or None); the stream must end with [DONE]."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, error, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                continue
            text += event["choices"][0]["text"]
            if first_chunk is not None:
                first_chunk.set()
    assert done
    return text, error


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--data-parallel-size", str(NUM_REPLICAS)]) as server:
        server.started_pids = descendants(server.proc.pid)
        yield server
        started = server.started_pids | descendants(server.proc.pid)
        server.stop()
        assert wait_gone(started) == set(), "processes outlived the server"


# ---- tests ----------------------------------------------------------------------------------

def test_replicas_are_processes_of_the_server(server):
    assert len(replica_pids(server)) == NUM_REPLICAS
    threads = os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // 2)
    assert "2 engine replicas ready" in server.log_text()
    assert f"{threads} CPU threads each" in server.log_text()  # cpus // N (or OMP_NUM_THREADS)
    assert per_replica(server, "dp_replica_healthy") == [1.0, 1.0]
    # The web page's live view shows the replicas together.
    with httpx.stream("GET", server.url + "/v1/engine/stream", timeout=30) as events:
        first = json.loads(next(line for line in events.iter_lines()
                                if line.startswith("data: "))[len("data: "):])
    assert first["kv"]["num_blocks"] == sum(per_replica(server, "num_kv_blocks")) > 0


def test_32_concurrent_streams_match_greedy_alone_and_use_both_replicas(server, bundled_llm):
    distinct = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=16)
    alone = {p: bundled_llm.generate([p], params, use_tqdm=False)[0].outputs[0].text
             for p in distinct}
    prompts = distinct * 2
    before = per_replica(server, "generation_tokens_total")

    async def main() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=server.url + "/v1", timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, int]:
        """(text, completion tokens)"""
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, num_tokens = "", 0
        async with client.stream("POST", "/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["text"]
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
        return text, num_tokens

    results = asyncio.run(main())
    assert [text for text, _ in results] == [alone[p] for p in prompts]
    num_tokens = sum(n for _, n in results)

    def gained() -> list[float]:
        return [a - b for a, b in zip(per_replica(server, "generation_tokens_total"), before)]

    wait_for(lambda: sum(gained()) >= num_tokens, 10, "the replicas' snapshots")
    assert all(g > 0 for g in gained()), f"a replica served nothing: {gained()}"


def test_a_repeated_long_prefix_stays_on_one_replica(server):
    prefix = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(30))
    prompts = [f"{prefix}\nQuestion {q}: what is {q} squared? Answer:" for q in range(4)]
    hits_before = per_replica(server, "prefix_cache_hits_total")
    tokens_before = sum(per_replica(server, "prompt_tokens_total"))
    num_prompt_tokens = sum(complete(server, p)["usage"]["prompt_tokens"] for p in prompts)
    wait_for(lambda: sum(per_replica(server, "prompt_tokens_total"))
             >= tokens_before + num_prompt_tokens, 10, "the replicas' snapshots")
    hits = [a - b for a, b in zip(per_replica(server, "prefix_cache_hits_total"), hits_before)]
    # Without affinity idle replicas take turns, and both would hit from the third request.
    assert min(hits) == 0, f"the prefix was served by both replicas: {hits}"
    prefix_tokens = len(httpx.post(server.url + "/tokenize", json={"prompt": prefix})
                        .json()["tokens"])
    # (the block holding the prefix's last token may differ: it meets the question there)
    assert max(hits) >= 3 * (prefix_tokens // 16 - 1) * 16, hits


def test_a_killed_replica_fails_its_streams_and_comes_back(server):
    pids = replica_pids(server)
    prompts = [f"Story {i}: once upon a time, a {word}" for i, word in
               enumerate(["cat", "dog", "fox", "owl", "bee", "elk"])]

    async def main() -> list[tuple[str, dict | None]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream_completion(client, p, 160, e))
                     for p, e in zip(prompts, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            # The server notices, and keeps answering on the other replica meanwhile.
            await asyncio.to_thread(wait_for, lambda: 0.0 in per_replica(
                server, "dp_replica_healthy"), 10, "the replica to be marked down")
            health = await client.get("/health")
            assert health.status_code == 200
            during = await client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
            assert during.status_code == 200, during.text
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)  # never a hang

    results = asyncio.run(main())
    failed = [error for _, error in results if error is not None]
    finished = [text for text, error in results if error is None]
    assert failed and finished, results
    for error in failed:
        assert "died" in error["message"] and error["type"] == "server_error"
    assert all(text for text in finished)
    # It comes back as a new process of the same index, and serves again.
    wait_for(lambda: sum(per_replica(server, "dp_replica_restarts_total")) == 1, 30,
             "a restart")
    index = per_replica(server, "dp_replica_restarts_total").index(1.0)
    wait_for(lambda: per_replica(server, "dp_replica_healthy") == [1.0, 1.0], 180,
             "the replica to come back")
    new_pids = replica_pids(server)
    assert len(new_pids) == NUM_REPLICAS and len(new_pids - pids) == 1
    server.started_pids |= new_pids
    before = per_replica(server, "generation_tokens_total")[index]
    for i in range(4):  # idle replicas take turns: two of these go to the new one
        complete(server, f"Tell me about the number {i}.")
    wait_for(lambda: per_replica(server, "generation_tokens_total")[index] > before, 10,
             "the restarted replica to serve")


def test_sigterm_stops_the_server_and_all_its_processes(server):
    started = server.started_pids | descendants(server.proc.pid)
    assert len([p for p in started if alive(p)]) >= NUM_REPLICAS
    assert server.stop() == 0
    assert wait_gone(started) == set()
    assert "Pagoda server stopped" in server.log_text()


PARENT = textwrap.dedent("""
    import os, sys, time
    from pagoda.config import EngineConfig
    from pagoda.engine.data_parallel.launcher import launch_replica
    from pagoda.engine.data_parallel.replica_spec import ReplicaSpec
    spec = ReplicaSpec(0, EngineConfig.from_kwargs(dtype="float32"), 1, os.getpid(), 30)
    replica = launch_replica(spec)
    print(replica.pid, flush=True)
    time.sleep(600)
""")


def test_a_replica_dies_with_its_server_process():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        replica = int(parent.stdout.readline())
        assert alive(replica)
        time.sleep(1.0)  # (it may still be importing: PR_SET_PDEATHSIG or the ppid check)
        parent.kill()
        parent.wait()
        assert wait_gone({replica}, 4) == set()  # (loading takes longer: no EOF seen yet)
    finally:
        parent.kill()
        parent.wait()


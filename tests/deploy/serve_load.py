"""Helpers of the Ray Serve tests: a background load of streamed greedy completions that
records each request's outcome (its replica, its text, how it failed), and Serve's replica
states."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass

import httpx

MODEL = "tiny"
PROMPTS = [f"Tell me about the number {n} and why" for n in range(12)]
MAX_TOKENS = 24


def request_body(prompt: str, stream: bool = True, model: str = MODEL,
                 max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


@dataclass
class Outcome:
    prompt: str
    status: int | None = None
    replica: str | None = None
    """x-pagoda-replica of the response (None: no response started)."""
    text: str = ""
    error: str | None = None
    """None: a whole answer ([DONE] seen); else the error event's code, 'http <status>' or
    the exception."""
    retry_after: str | None = None
    start: float = 0.0
    """time.monotonic() when it was sent."""
    ttft: float | None = None
    """Seconds to the first text (None: none came)."""


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str,
                     open_streams: dict | None = None, **body: object) -> Outcome:
    """One streamed greedy completion; `body`: request_body's model / max_tokens."""
    outcome = Outcome(prompt, start=time.monotonic())
    key = object()
    try:
        async with client.stream("POST", url + "/v1/completions",
                                 json=request_body(prompt, **body)) as response:
            outcome.status = response.status_code
            outcome.replica = response.headers.get("x-pagoda-replica")
            outcome.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"http {response.status_code}"
                return outcome
            if open_streams is not None:
                open_streams[key] = outcome.replica
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.error = event["error"].get("code") or "error event"
                    continue
                if outcome.ttft is None:
                    outcome.ttft = time.monotonic() - outcome.start
                outcome.text += event["choices"][0]["text"]
            if not done and outcome.error is None:
                outcome.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        outcome.error = repr(e)
    finally:
        if open_streams is not None:
            open_streams.pop(key, None)
    return outcome


class Load:
    """`concurrency` clients, each sending streamed requests one after another (prompts in
    turn) until stop(); runs on its own thread and event loop. Up to `max_concurrency`
    clients exist; setting `concurrency` lower or higher (a ramp) pauses or wakes them."""

    def __init__(self, url: str, concurrency: int, max_concurrency: int | None = None,
                 **body: object) -> None:
        self.url = url
        self.body = body
        self.concurrency = concurrency
        self.max_concurrency = max(concurrency, max_concurrency or concurrency)
        self.outcomes: list[Outcome] = []
        self.open_streams: dict = {}
        """Streams started and not ended -> their replica (what a kill costs at most)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        prompts = itertools.cycle(PROMPTS)
        async with httpx.AsyncClient(timeout=120) as client:
            async def worker(index: int) -> None:
                while not self._stop.is_set():
                    if index >= self.concurrency:
                        await asyncio.sleep(0.1)
                        continue
                    self.outcomes.append(
                        await stream_one(client, self.url, next(prompts), self.open_streams,
                                     **self.body))

            await asyncio.gather(*(worker(i) for i in range(self.max_concurrency)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(timeout=180)
        return self.outcomes

    def wait_for(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < count and time.monotonic() < deadline:
            time.sleep(0.2)


def engine_replica_states(app: str = "pagoda") -> dict[str, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "PagodaEngine" not in status.deployments:
        return {}
    return dict(status.deployments["PagodaEngine"].replica_states)


def running_replicas(app: str = "pagoda") -> int:
    return engine_replica_states(app).get("RUNNING", 0)


def wait_until(predicate, timeout: float, what: str, period: float = 0.5) -> float:
    """Seconds it took `predicate()` to hold; AssertionError naming `what` after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what} ({engine_replica_states()})")
        time.sleep(period)
    return time.monotonic() - start


def engine_replica_actor(tag: str):
    """The Ray actor of the engine replica whose id is `tag`."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if "PagodaEngine" in entry["name"] and entry["name"].endswith(tag):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise KeyError(tag)

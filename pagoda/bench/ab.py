"""`pagoda bench ab`'s traffic: the same requests to two or more endpoints, interleaved.

The trace (a list of `TrafficEntry`, pagoda/bench/traffic.py) is cut into blocks of
`block_size` requests in arrival order. Each block is replayed to every endpoint in turn,
one endpoint at a time, the order alternating block by block (two endpoints: A B, B A, A B,
...; more: a rotation, reversed every other block) so that a machine that drifts (other
load, thermal, a cache warming) favours no endpoint. Within a block, requests start at their
recorded arrival times (relative to the block's first, multiplied by `time_scale`) or, with
`request_rate`, at Poisson times; a `max_concurrency` bounds the requests in flight. Every
request of the trace thus runs once on every endpoint per repeat: the records pair by `key`
(the entry's index), which the statistics (pagoda/bench/ab_stats.py) use.

Each endpoint's `duration` is the wall time of its own block passes only, so its throughput
is what it served while it had the machine's attention. Warm-up requests (untimed, unlike
the trace's prompts so that they warm no prefix cache for it) go to every endpoint first.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from pagoda.bench import BenchError
from pagoda.bench.client import RequestOptions, send_request
from pagoda.bench.metrics import RequestRecord
from pagoda.bench.serve import make_client, warm_up
from pagoda.bench.traffic import TrafficEntry

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Endpoint:
    name: str
    """How the report names it (A, B, or the user's)."""
    url: str
    """Base URL, without /v1."""
    model: str | None = None
    """The model name sent in every request (the server's first, when probed)."""
    label: str | None = None
    """The user's description (hardware, settings), shown beside the probed hardware."""
    cost_per_hour: float | None = None
    hardware: dict | None = None
    """What the server says it runs on (Pagoda's /version, llama.cpp's /props), if anything."""

    def to_json(self) -> dict:
        return {"name": self.name, "url": self.url, "model": self.model, "label": self.label,
                "cost_per_hour": self.cost_per_hour, "hardware": self.hardware}


@dataclass(frozen=True)
class ReplayConfig:
    block_size: int = 32
    """Requests per block; every block runs on every endpoint before the next block."""
    repeats: int = 1
    """Passes over the whole trace."""
    time_scale: float = 1.0
    """Recorded gaps between arrivals are multiplied by this (0.5: twice as fast)."""
    request_rate: float | None = None
    """Poisson arrivals at this rate (requests/s) instead of the recorded times; inf: all
    of a block at once."""
    max_concurrency: int | None = None
    num_warmups: int = 2
    """Untimed requests to each endpoint before the first block."""
    match_output_lengths: bool = True
    """Send max_tokens = the recorded output tokens with ignore_eos/min_tokens, so that
    both endpoints generate exactly the recorded lengths."""
    timeout: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale must be a positive number, got {self.time_scale}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")


def block_order(names: Sequence[str], block: int) -> list[str]:
    """The endpoints' order for block `block`: A B / B A alternating for two; for more, the
    rotation by block // 2, reversed on odd blocks (each endpoint goes first and last
    equally often over a whole cycle)."""
    shift = (block // 2) % len(names) if len(names) > 2 else 0
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if block % 2 else order


def blocks_of(entries: Sequence[TrafficEntry], block_size: int) -> list[list[int]]:
    """Entry indices in arrival order, cut into blocks."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].arrival)
    return [order[i:i + block_size] for i in range(0, len(order), block_size)]


def block_start_times(entries: Sequence[TrafficEntry], block: Sequence[int],
                      config: ReplayConfig, rng: np.random.Generator) -> list[float]:
    """Seconds after the block's start at which each of its requests is sent."""
    if config.request_rate is None:
        first = entries[block[0]].arrival
        return [(entries[i].arrival - first) * config.time_scale for i in block]
    if math.isinf(config.request_rate):
        return [0.0] * len(block)
    gaps = rng.exponential(1.0 / config.request_rate, size=len(block))
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def is_greedy(body: dict) -> bool:
    """Temperature 0 (OpenAI's default temperature is 1) and one choice: outputs comparable."""
    return body.get("temperature") == 0 and body.get("n", 1) == 1


def replay_body(entry: TrafficEntry, endpoint: Endpoint, config: ReplayConfig) -> dict:
    """The request to send: the recorded body, streamed with usage (TTFT and token counts
    need both), with this endpoint's model name and, if asked, the recorded output length."""
    body = copy.deepcopy(entry.body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if endpoint.model is not None:
        body["model"] = endpoint.model
    if config.match_output_lengths and entry.output_tokens:
        body.pop("max_completion_tokens", None)
        body.update(max_tokens=entry.output_tokens, min_tokens=entry.output_tokens,
                    ignore_eos=True)
    return body


def check_trace(entries: Sequence[TrafficEntry]) -> None:
    if not entries:
        raise BenchError("the traffic has no requests")
    for i, entry in enumerate(entries):
        if entry.endpoint not in GENERATION_ENDPOINTS:
            raise BenchError(f"traffic entry {i}: endpoint {entry.endpoint!r} cannot be "
                             f"replayed (only {', '.join(GENERATION_ENDPOINTS)})")


async def _send(client: httpx.AsyncClient, endpoint: Endpoint, entry: TrafficEntry, key: int,
                config: ReplayConfig, delay: float, block_start: float,
                semaphore: asyncio.Semaphore | None, run_start: float) -> tuple[RequestRecord, str]:
    wait = block_start + delay - time.perf_counter()
    if wait > 0:
        await asyncio.sleep(wait)
    options = RequestOptions(endpoint=entry.endpoint, model=endpoint.model, timeout=config.timeout)
    record = RequestRecord(index=key)
    body = replay_body(entry, endpoint, config)
    if semaphore is None:
        text = await send_request(client, endpoint.url, options, body, record, run_start)
    else:
        async with semaphore:
            text = await send_request(client, endpoint.url, options, body, record, run_start)
    return record, text


async def _run_block(client, endpoint, entries, block, starts, config, run_start):
    """Every request of `block` to `endpoint`; returns their (record, text) and the pass's
    wall time."""
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    block_start = time.perf_counter()
    results = await asyncio.gather(*(
        _send(client, endpoint, entries[i], i, config, start, block_start, semaphore, run_start)
        for i, start in zip(block, starts)))
    return results, time.perf_counter() - block_start


async def run_ab(
    endpoints: Sequence[Endpoint], entries: Sequence[TrafficEntry], config: ReplayConfig,
    api_key: str | None = None, progress=None,
) -> tuple[list[dict], dict[str, float]]:
    """Replay `entries` to every endpoint as the module docstring says. Returns the request
    rows (pagoda/bench/ab_stats.py's input: RequestRecord fields plus endpoint, key,
    repeat, block, greedy, output_text) and each endpoint's serving time in seconds."""
    check_trace(entries)
    names = [e.name for e in endpoints]
    by_name = {e.name: e for e in endpoints}
    blocks = blocks_of(entries, config.block_size)
    rng = np.random.default_rng(config.seed)
    rows: list[dict] = []
    duration = dict.fromkeys(names, 0.0)
    connections = config.max_concurrency or max(1, config.block_size)
    async with make_client(api_key, connections) as client:
        for endpoint in endpoints:
            if config.num_warmups:
                options = RequestOptions(endpoint=entries[0].endpoint, model=endpoint.model,
                                         timeout=config.timeout)
                await warm_up(endpoint.url, options, config.num_warmups, api_key)
        run_start = time.perf_counter()
        block_number = 0
        for repeat in range(config.repeats):
            for block in blocks:
                # Every endpoint gets the same start times: the pairs see the same traffic.
                starts = block_start_times(entries, block, config, rng)
                for name in block_order(names, block_number):
                    results, elapsed = await _run_block(client, by_name[name], entries, block,
                                                        starts, config, run_start)
                    duration[name] += elapsed
                    for record, text in results:
                        greedy = is_greedy(entries[record.index].body)
                        rows.append({**record.to_json(), "endpoint": name, "key": record.index,
                                     "repeat": repeat, "block": block_number, "greedy": greedy,
                                     "output_text": text if greedy else None})
                    if progress is not None:
                        progress(len(results))
                block_number += 1
    return rows, duration


def probe_hardware(url: str, api_key: str | None) -> dict | None:
    """What the server says it runs on: Pagoda's GET /version (its models' `run`), else
    llama.cpp's GET /props (build, model file, slots); None when neither answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/version", "/props"):
        try:
            response = httpx.get(url + path, headers=headers, timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            continue
        try:
            data = response.json()
        except ValueError:
            continue
        if path == "/version" and isinstance(data, dict) and data.get("models"):
            run = data["models"][0].get("run") or {}
            return {"engine": f"pagoda {data.get('version')}", **run}
        if path == "/props" and isinstance(data, dict):
            keys = ("build_info", "model_path", "total_slots")
            found = {k: data[k] for k in keys if k in data}
            if found:
                return {"engine": "llama.cpp", **found}
    return None

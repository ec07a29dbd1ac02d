"""The serving benchmark's traffic: conversations arrive, their turns are sent, all timed.

Arrivals. Conversation i starts at the sum of i gaps drawn from a gamma distribution with
shape `burstiness` and mean 1/rate (burstiness 1 = a Poisson process; below 1 burstier,
above 1 steadier); rate inf sends everything at once. A `max_concurrency` bounds the
requests in flight (a semaphore around every request). A conversation's turns go one after
the other, each as soon as the previous reply has ended; if a turn fails, the later turns of
that conversation are recorded as 'skipped', so every request of the workload is accounted for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from pagoda.bench.client import RequestOptions, build_payload, send_request
from pagoda.bench.datasets import Conversation, num_requests
from pagoda.bench.metrics import RequestRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrafficConfig:
    request_rate: float = math.inf
    """Conversations per second; inf sends all at once."""
    burstiness: float = 1.0
    """Gamma shape of the gaps between arrivals; 1 is Poisson."""
    max_concurrency: int | None = None
    """Most requests in flight; None is no bound."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive or inf, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


def arrival_times(count: int, traffic: TrafficConfig) -> list[float]:
    """Seconds after the start at which each of `count` conversations begins."""
    if math.isinf(traffic.request_rate):
        return [0.0] * count
    rng = np.random.default_rng(traffic.seed)
    theta = 1.0 / (traffic.request_rate * traffic.burstiness)
    gaps = rng.gamma(shape=traffic.burstiness, scale=theta, size=count)
    gaps[0] = 0.0  # the first one starts the clock
    return [float(t) for t in np.cumsum(gaps)]


def spread_models(count: int, names: Sequence[str], seed: int) -> list[str]:
    """The `model` of each of `count` conversations, round-robin over `names` from a
    seeded starting point (--lora-names): every name gets count // len(names) or one more."""
    if not names:
        raise ValueError("--lora-names: give at least one name")
    start = int(np.random.default_rng(seed).integers(len(names)))
    return [names[(start + i) % len(names)] for i in range(count)]


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url!r}: must start with http:// or https://")
    return url.removesuffix("/v1")


def make_client(api_key: str | None, max_connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # Timeouts per request are enforced around the whole stream (RequestOptions.timeout).
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None, connect=30))


def probe_server(base_url: str, api_key: str | None) -> str | None:
    """GET /v1/models: raise ValueError if the server cannot be reached; return the first
    model's id (None if the server does not list one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url} ({type(e).__name__}: {e}); "
                         "is the server running?") from None
    if response.status_code == 401:
        raise ValueError(f"{base_url} wants an API key (HTTP 401); pass --api-key")
    if response.status_code != 200:
        return None
    try:
        data = response.json().get("data") or []
        return data[0]["id"] if data else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def _run_conversation(
    client: httpx.AsyncClient, base_url: str, options: RequestOptions,
    conversation: Conversation, records: list[RequestRecord], start_at: float,
    run_start: float, semaphore: asyncio.Semaphore | None, bar: tqdm, spread: bool = False,
) -> None:
    """`spread`: options.model is this conversation's share of --lora-names (recorded)."""
    delay = run_start + start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    replies: list[str] = []
    for turn, record in enumerate(records):
        record.model = options.model if spread else None
        payload = build_payload(options, conversation, turn, replies)
        if semaphore is not None:
            async with semaphore:
                reply = await send_request(client, base_url, options, payload, record, run_start)
        else:
            reply = await send_request(client, base_url, options, payload, record, run_start)
        bar.update(1)
        if not record.success:
            for later in records[turn + 1:]:
                later.start = time.perf_counter() - run_start
                later.error = f"skipped: turn {turn} of conversation {record.conversation} failed"
                later.error_kind = "skipped"
                later.expected_output_tokens = conversation.output_lens[later.turn]
                bar.update(1)
            return
        replies.append(reply)


async def run_traffic(
    base_url: str, conversations: Sequence[Conversation], options: RequestOptions,
    traffic: TrafficConfig, api_key: str | None = None, description: str = "requests",
    show_progress: bool = True, models: Sequence[str] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send the whole workload; return one record per turn (workload order) and the run's
    duration in seconds (first send to last end). `models`: the `model` each conversation
    sends (spread_models), recorded per request; None: options.model for all."""
    records_by_conversation: list[list[RequestRecord]] = []
    records: list[RequestRecord] = []
    for c_index, conversation in enumerate(conversations):
        group = []
        for turn in range(len(conversation.turns)):
            record = RequestRecord(index=len(records), conversation=c_index, turn=turn)
            group.append(record)
            records.append(record)
        records_by_conversation.append(group)
    starts = arrival_times(len(conversations), traffic)
    semaphore = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    max_connections = traffic.max_concurrency or max(1, len(conversations))
    async with make_client(api_key, max_connections) as client:
        with tqdm(total=len(records), desc=description, unit="req",
                  disable=not show_progress) as bar:
            run_start = time.perf_counter()
            await asyncio.gather(*(
                _run_conversation(
                    client, base_url,
                    options if models is None else dataclasses.replace(options, model=models[i]),
                    conversation, group, start, run_start, semaphore, bar, models is not None)
                for i, (conversation, group, start) in enumerate(
                    zip(conversations, records_by_conversation, starts))
            ))
            duration = time.perf_counter() - run_start
    assert len(records) == num_requests(conversations)
    return records, duration


async def warm_up(
    base_url: str, options: RequestOptions, num_warmups: int, api_key: str | None
) -> None:
    """Send a few short untimed requests so that lazy start-up work on the server does not
    land in the first measured ones. Their prompts are unlike the workload's, so that they
    warm no prefix cache for it."""
    async with make_client(api_key, 1) as client:
        for i in range(num_warmups):
            warm = Conversation(turns=[f"Warm-up request {i}: say something about the weather."],
                                output_lens=[8])
            record = RequestRecord(index=-1)
            payload = build_payload(options, warm, 0, [])
            await send_request(client, base_url, options, payload, record, time.perf_counter())
            if not record.success:
                logger.warning("warm-up request failed: %s", record.error)

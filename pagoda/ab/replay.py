"""`pagoda bench ab`'s traffic: the same requests to two or more endpoints, interleaved.

Conversations. A chat request whose messages begin with an earlier request's messages
followed by an assistant message (that request's reply) is the next turn of its
conversation; every other request is a conversation of its own. A user waits for a reply
before the next turn, so a turn is replayed once the previous turn's reply has ended on the
endpoint being measured, plus the pause the user took when recorded (its arrival minus the
previous turn's arrival and server-side latency). A slow server thus gets its later turns
later, as it would from real users, not piled up at the times a faster one set. And a turn
carries the endpoint's own earlier replies in place of the recorded ones, as the user would
have seen them: a server whose reply differs from the recorded one is not sent a history
that misses its prompt cache (`recorded_replies` sends the recorded ones).

Blocks. The conversations, in order of first arrival, are cut into blocks of at least
`block_size` requests (whole conversations). Each block is replayed to every endpoint in
turn, one endpoint at a time, the order alternating block by block (two endpoints: A B, B A,
A B, ...; more: a rotation, reversed every other block) so that a machine that drifts (other
load, thermal, a cache warming) favours no endpoint. Within a block, conversations start at
their recorded times (relative to the block's first, times `time_scale`) or, with
`request_rate`, at Poisson times; a `max_concurrency` bounds the requests in flight. Every
request of the trace thus runs once on every endpoint per repeat: the records pair by `key`
(the entry's index), which the statistics (pagoda/ab/stats.py) use.

Each endpoint's `duration` is the wall time of its own block passes only, so its throughput
is what it served while it had the machine's attention. Warm-up requests (untimed, unlike
the trace's prompts so that they warm no prefix cache for it) go to every endpoint first.
"""

from __future__ import annotations

import asyncio
import copy
import json
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
from pagoda.traffic_record import TrafficEntry

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
    warm_repeats: bool = False
    """Repeat the very same prompts. By default a pass after the first puts a tag of its
    number in front of every conversation's first message (or prompt), the same on every
    endpoint, so that no prompt cache serves a pass from what an earlier pass left."""
    time_scale: float = 1.0
    """Recorded gaps between arrivals are multiplied by this (0.5: twice as fast)."""
    request_rate: float | None = None
    """Conversations start at Poisson times at this rate per second (a single request is a
    conversation) instead of the recorded times; inf: all of a block's at once. Later turns
    still follow their replies."""
    max_concurrency: int | None = None
    num_warmups: int = 2
    """Untimed requests to each endpoint before the first block."""
    match_output_lengths: bool = True
    """Send max_tokens = the recorded output tokens with ignore_eos/min_tokens, so that
    both endpoints generate exactly the recorded lengths."""
    recorded_replies: bool = False
    """Later turns of a conversation carry the recorded replies, not the endpoint's own."""
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


def _messages_key(messages) -> str:
    return json.dumps(messages, sort_keys=True, separators=(",", ":"))


def conversations_of(entries: Sequence[TrafficEntry]) -> list[list[int]]:
    """Entry indices grouped into conversations (module docstring), each in arrival order;
    the conversations in order of their first arrival."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].arrival)
    conversations: list[list[int]] = []
    # a last turn's messages -> the conversations waiting on it, oldest first (two users may
    # have sent the very same first turn)
    tails: dict[str, list[int]] = {}
    for i in order:
        entry = entries[i]
        messages = entry.body.get("messages") if entry.endpoint == "chat" else None
        owner = None
        if isinstance(messages, list):
            for cut in range(len(messages) - 1, 0, -1):
                turn = messages[cut]
                waiting = tails.get(_messages_key(messages[:cut]))
                if isinstance(turn, dict) and turn.get("role") == "assistant" and waiting:
                    owner = waiting.pop(0)
                    break
        if owner is None:
            owner = len(conversations)
            conversations.append([])
        conversations[owner].append(i)
        if isinstance(messages, list):
            tails.setdefault(_messages_key(messages), []).append(owner)
    return conversations


def blocks_of(conversations: Sequence[Sequence[int]], block_size: int) -> list[list[list[int]]]:
    """Whole conversations, in order, cut into blocks of at least `block_size` requests."""
    blocks: list[list[list[int]]] = [[]]
    count = 0
    for conversation in conversations:
        if count >= block_size:
            blocks.append([])
            count = 0
        blocks[-1].append(list(conversation))
        count += len(conversation)
    return [b for b in blocks if b]


def block_start_times(entries: Sequence[TrafficEntry], block: Sequence[Sequence[int]],
                      config: ReplayConfig, rng: np.random.Generator) -> list[float]:
    """Seconds after the block's start at which each of its conversations begins."""
    if config.request_rate is None:
        first = entries[block[0][0]].arrival
        return [(entries[c[0]].arrival - first) * config.time_scale for c in block]
    if math.isinf(config.request_rate):
        return [0.0] * len(block)
    gaps = rng.exponential(1.0 / config.request_rate, size=len(block))
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def pause_before(entries: Sequence[TrafficEntry], previous: int, turn: int,
                 config: ReplayConfig) -> float:
    """The user's recorded pause between the end of `previous`'s reply and sending `turn`
    (without a recorded latency: the whole gap between their arrivals), times time_scale."""
    gap = entries[turn].arrival - entries[previous].arrival
    latency = entries[previous].latency
    return max(0.0, gap - (latency or 0.0)) * config.time_scale


def is_greedy(body: dict) -> bool:
    """Temperature 0 (OpenAI's default temperature is 1) and one choice: outputs comparable."""
    return body.get("temperature") == 0 and body.get("n", 1) == 1


def repeat_tag(repeat: int) -> str:
    return f"[pass {repeat + 1}] "


def _tagged(body: dict, tag: str) -> None:
    """`tag` in front of the first message's text (chat) or every prompt (completions)."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            and isinstance(messages[0].get("content"), str):
        messages[0] = {**messages[0], "content": tag + messages[0]["content"]}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = tag + prompt
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        body["prompt"] = [tag + p for p in prompt]


def replay_body(entry: TrafficEntry, endpoint: Endpoint, config: ReplayConfig,
                messages: list | None = None, repeat: int = 0) -> dict:
    """The request to send: the recorded body (with `messages` in place of the recorded
    ones, if given: they carry their pass's tag already), tagged with its pass after the
    first (ReplayConfig.warm_repeats), streamed with usage (TTFT and token counts need
    both), with this endpoint's model name and, if asked, the recorded output length."""
    body = copy.deepcopy(entry.body)
    if messages is not None:
        body["messages"] = messages
    elif repeat and not config.warm_repeats:
        _tagged(body, repeat_tag(repeat))
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


def with_live_replies(previous_sent: list, reply: str, previous_recorded: list,
                      recorded: list) -> list:
    """A turn's messages with the endpoint's own earlier replies: what the previous turn
    sent, this endpoint's reply to it, then what the recorded turn added after the recorded
    reply (its new user message)."""
    return [*previous_sent, {"role": "assistant", "content": reply},
            *recorded[len(previous_recorded) + 1:]]


async def _send(client: httpx.AsyncClient, endpoint: Endpoint, entry: TrafficEntry, key: int,
                config: ReplayConfig, semaphore: asyncio.Semaphore | None,
                run_start: float, messages: list | None = None,
                repeat: int = 0) -> tuple[tuple[RequestRecord, str], list | None]:
    """The request's (record, text), and the messages it sent (chat; None otherwise)."""
    options = RequestOptions(endpoint=entry.endpoint, model=endpoint.model, timeout=config.timeout)
    record = RequestRecord(index=key)
    body = replay_body(entry, endpoint, config, messages, repeat)
    if semaphore is None:
        text = await send_request(client, endpoint.url, options, body, record, run_start)
    else:
        async with semaphore:
            text = await send_request(client, endpoint.url, options, body, record, run_start)
    return (record, text), body.get("messages")


async def _run_conversation(client, endpoint, entries, conversation, start, block_start,
                            config, semaphore, run_start, repeat):
    """The turns of one conversation to `endpoint`, each after the previous one's reply
    and the user's recorded pause, each carrying the endpoint's own earlier replies (unless
    `config.recorded_replies`, or a previous turn failed: then the recorded ones)."""
    results = []
    wait = block_start + start - time.perf_counter()
    sent: list | None = None  # the messages the previous turn sent, while live
    for n, i in enumerate(conversation):
        messages = None
        if n:
            previous = conversation[n - 1]
            wait = pause_before(entries, previous, i, config)
            record, reply, _ = results[-1]
            if sent is not None and record.success and not config.recorded_replies:
                messages = with_live_replies(sent, reply, entries[previous].body["messages"],
                                             entries[i].body["messages"])
        if wait > 0:
            await asyncio.sleep(wait)
        result, sent = await _send(client, endpoint, entries[i], i, config, semaphore,
                                   run_start, messages, repeat)
        results.append((*result, messages is not None))
        if not result[0].success:
            sent = None
    return results


async def _run_block(client, endpoint, entries, block, starts, config, run_start, repeat):
    """Every conversation of `block` to `endpoint`; returns their requests' (record, text,
    whether it carried this endpoint's own earlier replies) and the pass's wall time."""
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    block_start = time.perf_counter()
    per_conversation = await asyncio.gather(*(
        _run_conversation(client, endpoint, entries, conversation, start, block_start, config,
                          semaphore, run_start, repeat)
        for conversation, start in zip(block, starts)))
    return [r for results in per_conversation for r in results], \
        time.perf_counter() - block_start


async def run_ab(
    endpoints: Sequence[Endpoint], entries: Sequence[TrafficEntry], config: ReplayConfig,
    api_key: str | None = None, progress=None,
) -> tuple[list[dict], dict[str, float]]:
    """Replay `entries` to every endpoint as the module docstring says. Returns the request
    rows (pagoda/ab/stats.py's input: RequestRecord fields plus endpoint, key,
    repeat, block, greedy, output_text, live_history: the turn carried this endpoint's own
    earlier replies) and each endpoint's serving time in seconds."""
    check_trace(entries)
    names = [e.name for e in endpoints]
    by_name = {e.name: e for e in endpoints}
    blocks = blocks_of(conversations_of(entries), config.block_size)
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
                                                        starts, config, run_start, repeat)
                    duration[name] += elapsed
                    for record, text, live_history in results:
                        greedy = is_greedy(entries[record.index].body)
                        rows.append({**record.to_json(), "endpoint": name, "key": record.index,
                                     "repeat": repeat, "block": block_number, "greedy": greedy,
                                     "output_text": text if greedy else None,
                                     "live_history": live_history})
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

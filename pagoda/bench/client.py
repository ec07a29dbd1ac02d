"""One streamed OpenAI-protocol request, timed chunk by chunk (httpx, asyncio).

Every outcome lands in the request's `RequestRecord`; nothing is raised to the caller:

| what happened                                    | error_kind   |
|--------------------------------------------------|--------------|
| status >= 400                                    | 'http'       |
| could not connect                                | 'connection' |
| connection lost mid-stream                       | 'dropped'    |
| --timeout passed                                 | 'timeout'    |
| no `data: [DONE]`, bad JSON, an `error` event    | 'protocol'   |
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from pagoda.bench.datasets import Conversation
from pagoda.bench.metrics import RequestRecord

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestOptions:
    """What every request of a run sends besides the prompt."""

    endpoint: str = "completions"
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    """Send vLLM's extras ignore_eos and min_tokens so every output has max_tokens tokens."""
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0
    """Seconds one request may take in all."""


def conversation_messages(
    conversation: Conversation, turn: int, replies: list[str]
) -> list[dict[str, str]]:
    """The chat messages of `turn`: the preamble, earlier turns with their real replies, then
    this turn's user message."""
    messages = list(conversation.history)
    for user, reply in zip(conversation.turns[:turn], replies):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": conversation.turns[turn]})
    return messages


def build_payload(
    options: RequestOptions, conversation: Conversation, turn: int, replies: list[str]
) -> dict:
    messages = conversation_messages(conversation, turn, replies)
    max_tokens = conversation.output_lens[turn]
    payload: dict = {}
    if options.model is not None:
        payload["model"] = options.model
    if options.endpoint == "chat":
        payload["messages"] = messages
    else:
        # Completions get the plain concatenation: a single-turn prompt is then exactly the
        # text built to the asked length, and a conversation's prompt grows by appending.
        payload["prompt"] = "".join(m["content"] for m in messages)
    payload.update(
        max_tokens=max_tokens, temperature=options.temperature, stream=True,
        stream_options={"include_usage": True},
    )
    if options.ignore_eos:
        payload.update(ignore_eos=True, min_tokens=max_tokens)
    payload.update(options.extra_body)
    return payload


def _error_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        error = json.loads(text)
        if isinstance(error, dict):
            error = error.get("error", error)
            if isinstance(error, dict):
                text = str(error.get("message", error))
    except ValueError:
        pass
    return f"HTTP {status}: {text[:200] or '(empty body)'}"


def _output_text(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def _stream(
    client: httpx.AsyncClient, url: str, payload: dict, endpoint: str, record: RequestRecord,
    t0: float, pieces: list[str],
) -> None:
    async with client.stream("POST", url, json=payload) as response:
        record.http_status = response.status_code
        if response.status_code >= 400:
            body = await response.aread()
            record.error, record.error_kind = _error_message(response.status_code, body), "http"
            return
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            now = time.perf_counter() - t0
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                record.error, record.error_kind = f"bad JSON in the stream: {data[:80]!r}", "protocol"
                return
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                error = chunk["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                record.error, record.error_kind = f"error event: {message}", "protocol"
                return
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens")
            got_text = False
            for choice in chunk.get("choices") or []:
                text = _output_text(choice, endpoint)
                if text:
                    pieces.append(text)
                    got_text = True
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            if got_text:
                record.chunk_times.append(now)
        if not done:
            record.error = f"stream ended without data: [DONE] after {len(pieces)} chunks"
            record.error_kind = "protocol"
            return
        record.success = True


async def send_request(
    client: httpx.AsyncClient, base_url: str, options: RequestOptions, payload: dict,
    record: RequestRecord, run_start: float,
) -> str:
    """Send one streamed request, fill `record` in, return the generated text."""
    url = base_url + ENDPOINT_PATHS[options.endpoint]
    pieces: list[str] = []
    t0 = time.perf_counter()
    record.start = t0 - run_start
    record.expected_output_tokens = payload.get("max_tokens")
    try:
        await asyncio.wait_for(
            _stream(client, url, payload, options.endpoint, record, t0, pieces), options.timeout
        )
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.error, record.error_kind = f"timed out after {time.perf_counter() - t0:.1f}s", "timeout"
    except httpx.ConnectError as e:
        record.error, record.error_kind = f"cannot connect: {e}", "connection"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
            httpx.NetworkError) as e:
        record.error = f"connection dropped after {len(record.chunk_times)} chunks: {e}"
        record.error_kind = "dropped"
    except httpx.HTTPError as e:
        record.error, record.error_kind = f"{type(e).__name__}: {e}", "protocol"
    record.latency = time.perf_counter() - t0
    if record.error is not None:
        record.success = False
    return "".join(pieces)

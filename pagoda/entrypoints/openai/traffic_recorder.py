"""`pagoda serve --record-traffic FILE [--record-redact]`: one traffic entry (pagoda/bench/
traffic.py) per request to /v1/completions and /v1/chat/completions.

    request ─ TrafficRecorderMiddleware ─ the app (the serving pipeline leaves the usage in
              │  copies the body as it is      the request's scope state: USAGE_STATE)
              │  read; times the response's chunks
              └─ at the response's end: TrafficEntry ─ queue ─ writer thread: redact, write

What it sees: arrival (seconds since the first request to these routes came in), the JSON
body, the status, ttft (the first body chunk of a stream that carries output; None for a
whole response) and latency (to the last body chunk), both from arrival; prompt and output
tokens as the pipeline counted them (None where it never got that far, e.g. a 400). Bodies
that are not a JSON object are not recorded (they cannot be replayed). The middleware sits
inside the API-key gate and the body cap: refused callers and oversized bodies are not
recorded.

Nothing here delays or fails a request: the event loop only queues the entry; a thread
redacts it (tokenizing) and writes the line. A write or redaction error logs one warning and
turns recording off.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.openai.serving.pipeline import USAGE_STATE
from pagoda.traffic_record import TrafficEntry, TrafficWriter, redact_body

logger = logging.getLogger(__name__)

RECORDED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
SOURCE = "pagoda serve"

TokenCounterFor = Callable[[str | None], Callable[[str], int]]
"""The token counter of the model a request names (None: the default model)."""


class TrafficRecorder:
    """The record file and the thread that writes it."""

    def __init__(self, path: str, count_tokens_for: TokenCounterFor | None = None) -> None:
        """`count_tokens_for`: redact bodies with these token counts; None: keep them as
        sent. Opens (empties) `path` at once: OSError if it cannot be written."""
        self.writer = TrafficWriter(path)
        self.count_tokens_for = count_tokens_for
        self.enabled = True
        self._start: float | None = None
        self._queue: queue.SimpleQueue[tuple[TrafficEntry, bytes] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_entries, name="traffic-recorder",
                                        daemon=True)
        self._thread.start()

    def arrival(self, now: float) -> float:
        """Seconds from the first request's arrival to `now` (perf_counter seconds)."""
        if self._start is None:
            self._start = now
        return now - self._start

    def submit(self, entry: TrafficEntry, raw_body: bytes) -> None:
        """Queue `entry` for the writer thread, which sets its body from `raw_body` (the
        request's bytes; skipped unless a JSON object). Never blocks, never raises."""
        if self.enabled:
            self._queue.put((entry, raw_body))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (for up to `timeout` seconds), then close the file."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.writer.close()

    def _write_entries(self) -> None:
        while (item := self._queue.get()) is not None:
            entry, raw_body = item
            if not self.enabled:
                continue
            try:
                body = json.loads(raw_body)
            except ValueError:
                continue
            if not isinstance(body, dict):
                continue
            entry.body = body
            try:
                if self.count_tokens_for is not None:
                    model = entry.body.get("model")
                    entry.body = redact_body(entry.body, self.count_tokens_for(
                        model if isinstance(model, str) else None))
                self.writer.write(entry)
            except Exception as e:  # noqa: BLE001 - recording must never take the server down
                self.enabled = False
                logger.warning("--record-traffic %s: cannot record (%s: %s); recording is "
                               "off from now on", self.writer.path, type(e).__name__, e)


class TrafficRecorderMiddleware:
    """Records each completions and chat request (plain ASGI: streaming-safe; it copies
    what passes and changes nothing)."""

    def __init__(self, app: ASGIApp, recorder: TrafficRecorder) -> None:
        self.app = app
        self.recorder = recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = RECORDED_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST" or not self.recorder.enabled:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        arrival = self.recorder.arrival(start)
        state = scope.setdefault("state", {})  # the pipeline leaves the usage here
        body_parts: list[bytes] = []
        status: int | None = None
        is_stream = False
        ttft: float | None = None
        end: float | None = None

        async def copy_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body_parts.append(message.get("body", b""))
            return message

        async def time_response(message: Message) -> None:
            nonlocal status, is_stream, ttft, end
            if message["type"] == "http.response.start":
                status = message["status"]
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                is_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                now = time.perf_counter()
                if is_stream and ttft is None and carries_output(message.get("body", b"")):
                    ttft = now - start
                if not message.get("more_body", False):
                    end = now
            await send(message)

        try:
            await self.app(scope, copy_body, time_response)
        except Exception:
            status = status or 500  # what the server's outermost handler answers
            raise
        finally:
            latency = (end if end is not None else time.perf_counter()) - start
            usage = state.get(USAGE_STATE)
            self.recorder.submit(TrafficEntry(
                arrival=arrival, endpoint=endpoint, body={},
                prompt_tokens=getattr(usage, "prompt_tokens", None),
                output_tokens=getattr(usage, "completion_tokens", None),
                ttft=ttft, latency=latency, status=status, source=SOURCE,
            ), b"".join(body_parts))


def carries_output(chunk: bytes) -> bool:
    """Whether a body chunk of an SSE response holds generated output: a completion's text,
    or a chat delta's content, reasoning or tool calls (not chat's opening role delta)."""
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            event: Any = json.loads(line[5:])
        except ValueError:
            continue  # [DONE]
        if not isinstance(event, dict):
            continue
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("content") or delta.get("reasoning_content") \
                        or delta.get("tool_calls"):
                    return True
            elif choice.get("text"):
                return True
    return False

"""`pagoda ab-proxy`: a live A/B test in front of real users, as a plain ASGI app.

```
user ──request──> proxy ──the same request──> primary ──bytes──> proxy ──the same bytes──> user
                    │ --mirror: a shadow copy of each generation request, in the background;
                    │           its answer is timed, then dropped
                    │ --split F: a fraction F of generation requests go to the candidate
                    └───────────────────────────> candidate
```
Invariants:
- The user's answer is the primary's bytes (status, headers less the hop-by-hop ones, body),
  relayed chunk by chunk as they arrive. Timing reads a copy of each chunk; nothing waits.
- The candidate never delays, changes or fails a user's answer. A shadow runs in a task of its
  own, on its own connection pool, sent once the user has the first bytes of the primary's
  answer, so that the candidate's work never lands between a user's request and its first
  token (each side is timed from its own send; the candidate's arrivals lag the primary's by
  the primary's time to first byte), at most --max-shadow-in-flight at once (more are
  dropped and counted, never queued), with --candidate-timeout bounding each silence.
  Under --split a candidate that fails before its first byte (connection error, 5xx,
  401/403/404/408/429, no headers within --candidate-timeout) hands the request to the
  primary; once it has answered, its answer is the user's.
- Each side of each generation request (POST /v1/completions, /v1/chat/completions) is one
  line of the record (proxy_record.py), both sides of a request under one key.
GET /ab-proxy/stats answers the counters (ProxyStats) as JSON; every other path is relayed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagoda.ab.proxy_config import ProxyConfig, ProxyStats
from pagoda.ab.proxy_record import RecordWriter, ResponseTimer, record_line
from pagoda.ab.proxy_upstream import Upstream, UpstreamError, UpstreamResponse
from pagoda.bench.metrics import RequestRecord

logger = logging.getLogger(__name__)

STATS_PATH = "/ab-proxy/stats"
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
"""Path -> is it chat. Only POSTs to these are mirrored, split and recorded."""
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"trailers",
                        b"transfer-encoding", b"upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
"""Request headers the upstream client writes itself (the body is sent whole: no 100-continue)."""
CANDIDATE_FALLBACK_STATUSES = frozenset({401, 403, 404, 408, 429})
"""Under --split, these (and every 5xx) send the request to the primary: the candidate is
misconfigured or overloaded, and the user would not have got them from the primary."""


@dataclass(frozen=True)
class Exchange:
    """What the proxy knows of one generation request."""

    key: int
    path: str
    chat: bool
    greedy: bool
    max_tokens: int | None


def forwardable_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes]
                        ) -> list[tuple[bytes, bytes]]:
    """Headers less `drop` and whatever the Connection header names (lower-cased names)."""
    named = {token.strip().lower() for name, value in raw if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name.lower(), value) for name, value in raw
            if name.lower() not in drop and name.lower() not in named]


def describe_failure(error: UpstreamError | asyncio.TimeoutError) -> tuple[str, str]:
    """(message, error_kind) in client.py's kinds."""
    if isinstance(error, UpstreamError):
        return str(error)[:300], error.kind
    return "no answer within --candidate-timeout", "timeout"


class ABProxy:
    """The ASGI app. Build it outside the event loop (opening --record may raise OSError);
    uvicorn's lifespan shutdown cancels the shadows and closes the clients and the record."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.stats = ProxyStats()
        self.started = time.perf_counter()
        self.next_key = 0
        self.rng = random.Random(config.seed)
        self.shadows: set[asyncio.Task] = set()
        self.writer = None
        if config.record_path is not None:
            header = {"kind": "ab-proxy", "primary": config.primary,
                      "candidate": config.candidate, "mode": "mirror" if config.mirror else "split",
                      "split": config.split, "started_at": time.time()}
            try:
                self.writer = RecordWriter(config.record_path, header)
            except OSError as e:
                raise ValueError(f"--record {config.record_path}: cannot open it "
                                 f"({e.strerror})") from None
        self.primary = Upstream(config.primary, connect_timeout=10.0)
        self.candidate = Upstream(config.candidate, connect_timeout=config.candidate_timeout)

    # ---- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if scope["path"] == STATS_PATH and scope["method"] == "GET":
                await _send_json(send, 200, self.stats_json())
            else:
                await self._proxy(scope, receive, send)
        elif scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.close()
            await send({"type": "lifespan.shutdown.complete"})
        # websockets are not relayed: uvicorn refuses them when the app returns

    def stats_json(self) -> dict:
        stats = {"mode": "mirror" if self.config.mirror else "split", "split": self.config.split,
                 "uptime_s": time.perf_counter() - self.started, **asdict(self.stats)}
        if self.writer is not None:
            stats["record"] = {"path": self.writer.path, "lines_written": self.writer.num_written,
                               "lines_dropped": self.writer.num_dropped,
                               "disabled": self.writer.disabled}
        return stats

    async def close(self) -> None:
        for task in list(self.shadows):
            task.cancel()
        await asyncio.gather(*self.shadows, return_exceptions=True)
        await self.primary.aclose()
        await self.candidate.aclose()
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)

    # ---- one request --------------------------------------------------------------------------

    async def _proxy(self, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the user left before sending the whole request
        self.stats.requests_forwarded += 1
        method, path = scope["method"], scope["path"]
        target = (scope.get("raw_path") or path.encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = forwardable_headers(scope["headers"], NOT_FORWARDED)
        exchange = None
        if method == "POST" and path in GENERATION_PATHS:
            exchange = self._exchange(path, body)
            self.stats.generation_requests += 1
            if (self.config.split is not None and self.rng.random() < self.config.split
                    and await self._serve_from_candidate(exchange, target, headers, body,
                                                         receive, send)):
                return
        timer = self._timer(exchange)
        try:
            upstream = await self.primary.open(method, target, headers, body)
        except UpstreamError as e:
            if exchange is not None and self.config.mirror:
                self._launch_shadow(exchange, target, headers, body)
            self.stats.primary_failures += 1
            message, kind = describe_failure(e)
            self._write("primary", exchange, timer, message, kind)
            logger.warning("the primary did not answer %s %s: %s", method, path, message)
            await _send_json(send, 502, {"error": {
                "message": f"ab-proxy: the primary {self.config.primary} did not answer "
                           f"({message})", "type": "bad_gateway", "param": None, "code": None}})
            return
        shadow = None
        if exchange is not None and self.config.mirror:
            shadow = functools.partial(self._launch_shadow, exchange, target, headers, body)
        await self._relay(upstream, "primary", exchange, timer, receive, send, then=shadow)

    def _exchange(self, path: str, body: bytes) -> Exchange:
        key = self.next_key
        self.next_key += 1
        payload = {}
        if self.writer is not None:  # only the record needs the body's fields
            try:
                payload = json.loads(body)
            except ValueError:
                pass
            payload = payload if isinstance(payload, dict) else {}
        greedy = payload.get("temperature") == 0 and payload.get("n") in (None, 1)
        max_tokens = payload.get("max_tokens", payload.get("max_completion_tokens"))
        return Exchange(key, path, GENERATION_PATHS[path], greedy,
                        max_tokens if isinstance(max_tokens, int) else None)

    def _timer(self, exchange: Exchange | None) -> ResponseTimer | None:
        if exchange is None or self.writer is None:
            return None
        record = RequestRecord(index=exchange.key, start=time.perf_counter() - self.started,
                               expected_output_tokens=exchange.max_tokens)
        return ResponseTimer(record, exchange.chat, keep_text=exchange.greedy)

    def _write(self, side: str, exchange: Exchange | None, timer: ResponseTimer | None,
               error: str | None = None, error_kind: str | None = None) -> None:
        if timer is None or exchange is None or self.writer is None:
            return
        timer.finish(error, error_kind)
        self.writer.write(record_line(side, exchange.key, exchange.path, exchange.greedy, timer))

    def _candidate_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        if self.config.api_key is None:
            return headers
        return [h for h in headers if h[0] != b"authorization"] + [
            (b"authorization", f"Bearer {self.config.api_key}".encode())]

    async def _relay(self, upstream: UpstreamResponse, side: str, exchange: Exchange | None,
                     timer: ResponseTimer | None, receive, send,
                     then: Callable[[], None] | None = None) -> None:
        """Send `upstream`'s answer to the user as its bytes arrive; time a copy. `then` runs
        once the user has the first bytes of the body (or the answer ended without any)."""
        if timer is not None:
            timer.headers(upstream.status, upstream.header(b"content-type"),
                          upstream.header(b"content-encoding"))
        error = kind = None
        left = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": upstream.status,
                        "headers": forwardable_headers(upstream.headers, HOP_BY_HOP)})
            async for data in upstream.chunks():
                if left.done():
                    error, kind = "the user disconnected", "cancelled"
                    break  # closing the upstream below lets the engine abort the request
                if timer is not None:
                    timer.feed(data)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if then is not None:
                    then, launch = None, then
                    launch()
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as e:
            # The upstream broke mid-answer: returning without ending the response makes uvicorn
            # close the user's connection, so the user sees the same break.
            error, kind = describe_failure(e)
            logger.warning("the %s's answer broke off: %s", side, error)
        except asyncio.CancelledError:
            error, kind = "the proxy stopped", "cancelled"
            raise
        finally:
            left.cancel()
            if then is not None and kind != "cancelled":  # no shadow for a request dropped
                then()
            await upstream.aclose()
            self._write(side, exchange, timer, error, kind)

    # ---- the candidate ------------------------------------------------------------------------

    def _launch_shadow(self, exchange: Exchange, target: str, headers, body: bytes) -> None:
        if self.stats.shadows_in_flight >= self.config.max_shadow_in_flight:
            self.stats.shadows_dropped += 1
            self._write("candidate", exchange, self._timer(exchange),
                        f"shadow not sent: {self.stats.shadows_in_flight} in flight "
                        "(--max-shadow-in-flight)", "shed")
            return
        self.stats.shadows_sent += 1
        self.stats.shadows_in_flight += 1
        task = asyncio.create_task(self._shadow(exchange, target, headers, body))
        self.shadows.add(task)
        task.add_done_callback(self.shadows.discard)

    async def _shadow(self, exchange: Exchange, target: str, headers, body: bytes) -> None:
        """Send the copy, read the whole answer (timed if recording), drop it."""
        timer = self._timer(exchange)
        error = kind = None
        failed = True
        try:
            upstream = await self.candidate.open("POST", target, self._candidate_headers(headers),
                                                 body, read_timeout=self.config.candidate_timeout)
            try:
                if timer is not None:
                    timer.headers(upstream.status, upstream.header(b"content-type"),
                                  upstream.header(b"content-encoding"))
                async for data in upstream.chunks():
                    if timer is not None:
                        timer.feed(data)
            finally:
                await upstream.aclose()
            failed = upstream.status >= 400
        except UpstreamError as e:
            error, kind = describe_failure(e)
        except asyncio.CancelledError:
            error, kind = "the proxy stopped", "cancelled"
            raise
        finally:
            self.stats.shadows_in_flight -= 1
            self._write("candidate", exchange, timer, error, kind)
            if failed or (timer is not None and not timer.record.success):
                self.stats.shadows_failed += 1

    async def _serve_from_candidate(self, exchange: Exchange, target: str, headers, body: bytes,
                                    receive, send) -> bool:
        """--split chose the candidate: relay its answer and return True, or record its
        failure before the first byte and return False (the primary serves the request)."""
        self.stats.split_to_candidate += 1
        timer = self._timer(exchange)
        try:
            # No read timeout once the answer has begun: from then on it is the user's.
            upstream = await asyncio.wait_for(
                self.candidate.open("POST", target, self._candidate_headers(headers), body),
                self.config.candidate_timeout)
        except (UpstreamError, asyncio.TimeoutError) as e:
            self.stats.split_fallbacks += 1
            self._write("candidate", exchange, timer, *describe_failure(e))
            return False
        status = upstream.status
        if status >= 500 or status in CANDIDATE_FALLBACK_STATUSES:
            await upstream.aclose()
            self.stats.split_fallbacks += 1
            if timer is not None:
                timer.headers(status, "", "")
            self._write("candidate", exchange, timer, f"HTTP {status} (served by the primary)",
                        "http")
            return False
        await self._relay(upstream, "candidate", exchange, timer, receive, send)
        return True


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None if the user disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

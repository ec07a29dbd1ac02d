"""Operational guards of the HTTP server: a request body cap and a per-request deadline.

- `BodyLimitMiddleware` refuses a body over `--max-request-bytes` with 413 (an OpenAI error
  body) before any handler runs: a declared Content-Length over the cap is refused unread,
  a chunked body as soon as it passes the cap. Bodies under it are replayed to the app.
- `RequestTimeout` / `until_deadline` / `with_deadline`: a request still generating
  `--request-timeout` seconds after it was accepted is aborted (its engine work freed) and
  answered 408: a JSON error for a whole response, an SSE error event (then [DONE]) for a
  stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.openai.protocol.errors import OpenAIError

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
"""16 MiB: room for prompts far beyond any context length this engine serves."""


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than this server accepts ({limit} bytes, "
                       "--max-request-bytes).", HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       "invalid_request_error", None, "request_too_large")


class BodyLimitMiddleware:
    """413 for HTTP request bodies over `limit` bytes (plain ASGI: streaming-safe)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await body_too_large(self.limit).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # read the body up to the cap (every route parses whole JSON bodies)
            message = await receive()
            if message["type"] != "http.request":
                break  # a disconnect: the app sees it next
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await body_too_large(self.limit).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                message = None
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            if message is not None:
                return message
            return await receive()

        await self.app(scope, replay, send)


class RequestTimeout(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds

    def error(self) -> OpenAIError:
        return OpenAIError(f"The request did not finish within {self.seconds:g} s "
                           "(--request-timeout); it was stopped.", HTTPStatus.REQUEST_TIMEOUT,
                           "timeout", None, "request_timeout")


async def with_deadline(work: Awaitable[T], seconds: float | None) -> T:
    """`work`'s result; RequestTimeout (work cancelled) after `seconds` (None: no limit)."""
    if seconds is None:
        return await work
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise RequestTimeout(seconds) from None


async def until_deadline(items: AsyncIterator[T], seconds: float | None) -> AsyncIterator[T]:
    """`items` as they come; RequestTimeout once `seconds` have passed (None: no limit)."""
    if seconds is None:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    iterator = aiter(items)
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(iterator), max(deadline - loop.time(), 0))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeout(seconds) from None
            yield item
    finally:
        await iterator.aclose()

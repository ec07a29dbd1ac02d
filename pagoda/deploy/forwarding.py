"""An HTTP request carried from the ingress to an engine replica, and played there into the
replica's own FastAPI app (pagoda/entrypoints/openai/server.py), unchanged.

What a replica's `handle` generator yields, in order (the ingress reads them):

    ACCEPTED                         at once: the replica has the request (the ingress's
                                     --assign-timeout covers only the wait before it)
    ("start", status, headers)       the app's http.response.start (headers: list of
                                     (bytes, bytes))
    b"..." ...                       the body, as the app sends it (SSE events one by one)

Ray-free and torch-free (unit-tested alone); `routing_text` is what the prefix-aware router
hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"
INTERNAL_ERROR_BODY = json.dumps({"error": {
    "message": "the engine replica's app ended without a response", "type": "server_error",
    "param": None, "code": None}}).encode()


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_text: str
    """The prompt as text ("" for requests without one): the router's prefix key."""


def routing_text(path: str, body: bytes) -> str:
    """The leading text of the prompt a request would run: a completion's prompt, a chat's
    messages (their JSON, which begins with the system prompt), a response's input; ""
    when the body is not a JSON object or the route has no prompt. Routing only: a bad body
    still reaches the app, which answers 400."""
    if not path.startswith("/v1/") or not body:
        return ""
    try:
        payload = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    for key in ("messages", "prompt", "input"):
        value = payload.get(key)
        if isinstance(value, str):
            return value
        if value is not None:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return ""


def http_scope(request: ForwardedRequest) -> dict:
    """The ASGI scope the replica's app sees."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.query_string, "headers": list(request.headers),
        "server": ("ray-serve-replica", 0), "client": ("ray-serve-ingress", 0),
        "state": {},
    }


async def play(app, request: ForwardedRequest) -> AsyncIterator[object]:
    """Run `request` through the ASGI `app`; yields ("start", status, headers) then body
    chunks. Closing the generator early (the client left) tells the app the client
    disconnected and cancels it, so the engine aborts the request."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(http_scope(request), receive, send)
        except Exception:  # the app's own 500 (if any) was sent already
            logger.exception("%s %s failed in the replica's app", request.method, request.path)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                started = True
                yield ("start", message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
        if not started:
            yield ("start", 500, [(b"content-type", b"application/json")])
            yield INTERNAL_ERROR_BODY
    finally:
        if not task.done():
            disconnected.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # the client left
                await task

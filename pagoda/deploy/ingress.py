"""The PagodaIngress deployment: every HTTP request Ray Serve's proxy receives, forwarded
whole to an engine replica (through a DeploymentHandle, so Ray Serve's router, ours:
prefix_router.py, picks the replica) and its response streamed back unchanged.

Failures, as the client sees them:
- no engine replica takes the request within --assign-timeout seconds (none alive, or all
  at --max-ongoing-requests): 503 with Retry-After and an OpenAI error body;
- the replica dies before its response started: the request is sent again, whole, to
  another replica (the client has seen nothing of it; Ray Serve's router has dropped the
  dead replica), up to START_ATTEMPTS replicas; after that the same 503;
- the replica dies mid-response: an SSE stream ends with an error event and [DONE]; any
  other body ends short (the connection closes).

Stateless and small (0 CPUs): --ingress-replicas of them (default 2, spread over nodes),
so none is a single point of failure; Ray Serve's proxy runs on every node.

No `from __future__ import annotations` here: serve.ingress re-binds the route methods, and
FastAPI must see `request: Request` as a class, not a string, or it asks for a query
parameter named request (422).
"""

import asyncio
import logging

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response, StreamingResponse

from pagoda.deploy.forwarding import ACCEPTED, ForwardedRequest, routing_text
from pagoda.entrypoints.openai.protocol.errors import OpenAIError
from pagoda.entrypoints.openai.serving.streaming import SSE_DONE, sse_error

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "2"
START_ATTEMPTS = 3
"""Replicas a request is sent to, one after another, while each dies before its response
starts (a replica killed, a node lost): the request is lost only once its response started
or this many replicas died under it."""
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


def unavailable(why: str) -> Response:
    return OpenAIError(f"No engine replica could take this request ({why}); retry shortly.",
                       503, "server_error", None, "no_replica_available",
                       headers={"Retry-After": RETRY_AFTER_S}).response()


def replica_lost_event() -> bytes:
    error = OpenAIError("The engine replica running this request died; the request was lost. "
                        "Retry it: new requests go to the living replicas.", 503,
                        "server_error", None, "replica_died")
    return (sse_error(error) + SSE_DONE).encode()


class NoReplica(Exception):
    """No replica started a response: the 503's reason."""


async def start_response(open_stream, assign_timeout: float, what: str = "request"):
    """Send a request to a replica and wait for its response to start: (chunks, status,
    headers), `chunks` the rest of the replica's stream (the body).

    `open_stream()` sends it anew (a streaming DeploymentHandle response: ACCEPTED, then
    ("start", status, headers), then the body). A replica that dies before its response
    started leaves the request to the next one (START_ATTEMPTS in all); NoReplica when none
    accepts it within `assign_timeout` seconds or every attempt's replica died."""
    reason = "no attempt made"
    for attempt in range(1, START_ATTEMPTS + 1):
        chunks = open_stream()
        try:
            first = await asyncio.wait_for(chunks.__anext__(), assign_timeout)
            assert first == ACCEPTED, first
        except asyncio.TimeoutError:
            chunks.cancel()
            raise NoReplica(f"waited {assign_timeout:g} s for one") from None
        except Exception as e:  # noqa: BLE001 - replica died or unavailable
            logger.warning("%s (attempt %d): replica failed before accepting: %r", what,
                           attempt, e)
            reason = "the replica chosen died"
            continue
        try:
            _, status, headers = await chunks.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died before its response
            logger.warning("%s (attempt %d): replica died before responding: %r", what,
                           attempt, e)
            reason = "the replica running it died"
            continue
        return chunks, status, headers
    raise NoReplica(f"{reason}, {START_ATTEMPTS} times")


@serve.ingress(app)
class PagodaIngress:
    def __init__(self, engine: DeploymentHandle, assign_timeout: float) -> None:
        self.engine = engine.options(stream=True)
        self.assign_timeout = assign_timeout

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]), body=body,
            routing_text=routing_text(request.url.path, body))
        try:
            chunks, status, headers = await start_response(
                lambda: self.engine.handle.remote(forwarded), self.assign_timeout,
                f"{request.method} {request.url.path}")
        except NoReplica as e:
            return unavailable(str(e))
        is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                     for k, v in headers)

        async def body_chunks():
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the replica died mid-response
                logger.warning("request %s %s: replica died mid-response: %r",
                               request.method, request.url.path, e)
                if is_sse:
                    yield replica_lost_event()
            finally:
                chunks.cancel()  # a no-op once finished; else the client left: abort it

        response = StreamingResponse(body_chunks(), status_code=status)
        response.raw_headers = list(headers)
        return response

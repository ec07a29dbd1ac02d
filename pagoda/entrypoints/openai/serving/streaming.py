"""What a response needs from the request's engine streams and its HTTP connection: waiting
for the last outputs, merging several streams as they come, noticing a client that went
away, and server-sent-event framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.loop.request_stream import RequestStream
from pagoda.entrypoints.openai.protocol.errors import OpenAIError
from pagoda.outputs import RequestOutput

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last (complete) output of each stream, gathered concurrently."""

    async def last(stream: RequestStream) -> RequestOutput:
        output = None
        async for output in stream:
            pass
        assert output is not None and output.finished
        return output

    return list(await asyncio.gather(*(last(s) for s in streams)))


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs from several streams as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            merged.put_nowait((index, e))
        finally:
            merged.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def run_until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (its `finally` aborts the requests) when the client goes
    away first: a non-streaming request must not keep the engine busy for nobody."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse(json.dumps(error.body()))


SSE_DONE = sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (cancelling the body iterator, whose `finally` aborts
    the request) as soon as the client disconnects, even while waiting for the engine.
    (Starlette's own StreamingResponse only notices on the next send under ASGI 2.4.)"""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        """`on_close` runs however the response ends; it must abort unfinished requests
        (the body iterator's own `finally` never runs if it was never started)."""
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()

"""What /v1/completions and /v1/chat/completions share: request checks, SamplingParams,
submitting to the async engine, SSE framing, and noticing clients that go away."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.request_stream import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    model_not_found,
    server_error,
    server_overloaded,
)
from pagoda.entrypoints.openai.protocol import SamplingRequestFields
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_N = 128
"""Most choices per request (OpenAI's limit for chat)."""
MIN_LOGPROB = -9999.0
"""JSON has no -inf: logprobs are clamped here (as vLLM does)."""

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def check_prompt_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(f"{param} is empty; give at least one token", param=param)
        vocab_size = self.engine.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"{param} token id {token_id} is out of range; ids must be in "
                    f"[0, {vocab_size})", param=param, code="invalid_value",
                )

    def check_context_length(
        self, num_prompt_tokens: int, max_tokens: int | None, where: str, param: str,
        max_tokens_param: str = "max_tokens",
    ) -> None:
        """400 if the prompt leaves no room, or prompt + max_tokens exceeds max_model_len."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{where} is {num_prompt_tokens} tokens, which leaves no room for the "
                f"completion. Please reduce the length of the {where}.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the {where}, {max_tokens} in the completion). Please reduce the length of "
                f"the {where} or completion.",
                param=max_tokens_param, code="context_length_exceeded",
            )

    def sampling_params(
        self,
        request: SamplingRequestFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        renamed: dict[str, str] | None = None,
    ) -> SamplingParams:
        """SamplingParams from the request; its ValueError becomes a 400 naming the field.

        `renamed` maps SamplingParams names to this endpoint's names (chat's logprobs is
        `top_logprobs`, its max_tokens may be `max_completion_tokens`)."""
        renamed = renamed or {}
        n = 1 if request.n is None else request.n
        if n > MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {n}", param="n",
                              code="invalid_value")
        logit_bias = None
        if request.logit_bias is not None:
            logit_bias = {}
            for key, bias in request.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise bad_request(
                        f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                        param="logit_bias", code="invalid_value",
                    ) from None
                logit_bias[token_id] = bias
        values = {
            "n": n,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "top_k": 0 if request.top_k is None else request.top_k,
            "min_p": 0.0 if request.min_p is None else request.min_p,
            "presence_penalty": request.presence_penalty or 0.0,
            "frequency_penalty": request.frequency_penalty or 0.0,
            "repetition_penalty": (
                1.0 if request.repetition_penalty is None else request.repetition_penalty
            ),
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": bool(request.ignore_eos),
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens or 0,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "include_stop_str_in_output": bool(request.include_stop_str_in_output),
            "skip_special_tokens": (
                True if request.skip_special_tokens is None else request.skip_special_tokens
            ),
            "logit_bias": logit_bias,
        }
        try:
            params = SamplingParams(**values)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            param = renamed.get(field, field) if field in values else None
            message = str(e)
            if param and param != field:
                message = message.replace(field, param, 1)
            raise bad_request(message, param=param, code="invalid_value") from None
        vocab_size = self.engine.vocab_size
        for name, token_ids in (("logit_bias", params.logit_bias or {}),
                                ("stop_token_ids", params.stop_token_ids)):
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise bad_request(
                        f"{name}: token id {token_id} is out of the vocabulary "
                        f"(size {vocab_size})", param=name, code="invalid_value",
                    )
        return params

    # ---- the engine ----------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int,
    ) -> RequestStream:
        try:
            return await self.engine.add_request(request_id, prompt_token_ids, params, priority)
        except QueueFullError as e:
            raise server_overloaded(str(e)) from None
        except EngineDeadError as e:
            raise server_error(str(e), HTTPStatus.SERVICE_UNAVAILABLE) from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def add_requests(
        self, items: list[tuple[str, list[int], SamplingParams]], priority: int
    ) -> list[RequestStream]:
        """Add several requests; if one is refused, abort the ones already added."""
        self.check_queue(sum(params.n for _, _, params in items))
        streams: list[RequestStream] = []
        try:
            for request_id, token_ids, params in items:
                streams.append(await self.add_request(request_id, token_ids, params, priority))
        except BaseException:
            self.abort(streams)
            raise
        return streams

    def check_queue(self, num_seqs: int) -> None:
        try:
            self.engine.check_queue(num_seqs)
        except QueueFullError as e:
            raise server_overloaded(str(e)) from None

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def engine_error(error: BaseException) -> OpenAIError:
    """An engine failure met after the request was accepted (not the client's fault)."""
    if isinstance(error, EngineDeadError):
        return server_error(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(error, EngineStepError):
        return server_error(str(error))
    return server_error(f"Internal server error: {type(error).__name__}: {error}")


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

"""The one path of /v1/completions and /v1/chat/completions; each endpoint supplies what differs.

    request ─ check model, field policy ─ SamplingParams ─ prompts (endpoint) ───────┐
    ┌─ InputProcessor (the one validation step) per prompt: EngineRequests ──────────┘
    └─ queue check ─ add to the engine ─┬─ stream: opening chunks, one chunk per delta
                                        │   (endpoint's shape), usage chunk, [DONE]
                                        └─ wait: 499 if the client leaves, response
                                            (endpoint's choices) with usage
    whatever happens, unfinished engine requests are aborted.

The field policy (protocol/field_policy.py): fields without meaning here get one warning line, fields
Pagoda cannot honour a 400 (the request's `unsupported_fields`).
A refused request raises InvalidRequestError (the server's handler makes it a 400 from its
`param` and `code`) or OpenAIError. Engine failures after acceptance become a 5xx, or an SSE
error event once streaming began.

An endpoint subclasses `ServingPipeline` and supplies:
    sampling_fields(request)     values SamplingParams does not take by the request's names
    build_prompts(request)       text and/or token ids of each prompt, and how errors name it
    response_choice(...)         one choice of the full response
    stream_choice(...)           one choice of a chunk (or a list: a chunk each), or None to
                                 send nothing yet
    opening_choices(job)         chunks sent before any output (chat's role deltas)
plus its response and chunk models. Prompt i's completion j is choice i * n + j.

Each call may serve as another name (`served_as`): a LoRA adapter's requests run on its base
model's handlers, answering with the adapter's name and carrying its LoRARequest. The handlers
themselves never change after the registry made them (one set per served model). The data a
request carries through here (ServedAs, SamplingFields, ServingJob, ...) is job.py's.

An endpoint built on another one's output (the Responses API on chat) calls its
`validate`, `add_requests`, then `wait_for_response` (the response object) or
`stream_chunks` (chunk objects, an OpenAIError last on failure): the same path without the
HTTP bodies.
"""

from __future__ import annotations

import math
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.loop.protocol import EngineClient
from pagoda.engine.loop.request_stream import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from pagoda.entrypoints.openai.protocol.errors import (
    OpenAIError,
    model_not_found,
    server_error,
    server_overloaded,
)
from pagoda.entrypoints.openai.protocol.requests import SamplingRequestFields
from pagoda.entrypoints.openai.protocol.responses import UsageInfo
from pagoda.entrypoints.openai.serving.guards import RequestTimeout, until_deadline, with_deadline
from pagoda.entrypoints.openai.serving.job import (
    ChoiceState,
    PromptInput,
    SamplingFields,
    ServedAs,
    ServingJob,
)
from pagoda.entrypoints.openai.serving.streaming import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    final_outputs,
    merge_streams,
    run_until_disconnect,
    sse,
    sse_error,
)
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0
"""JSON has no -inf: logprobs are clamped here (as vLLM does)."""

USAGE_STATE = "pagoda_usage"
"""Where a request's UsageInfo is left in its ASGI scope state (`raw_request.state`) once
counted, streamed or not, asked for or not: for middleware that records traffic
(traffic_recorder.py). The response does not change."""


class ServingPipeline(ABC):
    request_id_prefix: ClassVar[str]
    response_type: ClassVar[type[BaseModel]]
    """Takes id, model, choices and usage."""
    chunk_type: ClassVar[type[BaseModel]]
    """Takes id, created, model, choices and usage."""
    choice_state_type: ClassVar[type[ChoiceState]] = ChoiceState

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        """`engine`: the model's engine front-end (input_processor, check_queue, add_request,
        abort: pagoda/engine/loop/protocol.py)."""
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.request_timeout: float | None = None
        """Seconds a request may run before it is stopped with 408 (--request-timeout)."""
        self.default_max_tokens: int | None = None
        """The output cap of a request that gives none (--max-tokens-default), capped by the
        room its prompt leaves; None: up to the context."""

    def base(self) -> ServedAs:
        """Served as the base model itself, without an adapter."""
        return ServedAs(self.model_name)

    # ---- what each endpoint supplies ---------------------------------------------------------

    @abstractmethod
    def sampling_fields(self, request) -> SamplingFields: ...

    @abstractmethod
    def build_prompts(self, request) -> list[PromptInput]: ...

    @abstractmethod
    def response_choice(
        self, job: ServingJob, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput, index: int,
    ) -> BaseModel: ...

    @abstractmethod
    def stream_choice(
        self, job: ServingJob, state: ChoiceState, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput,
    ) -> BaseModel | list[BaseModel] | None:
        """The chunk choice for this delta (a list: one chunk each, in order), or None when
        there is nothing to send yet."""

    def opening_choices(self, job: ServingJob) -> list[BaseModel]:
        return []

    # ---- the pipeline ------------------------------------------------------------------------

    async def serve(self, request, raw_request: Request,
                    served_as: ServedAs | None = None) -> Response:
        """The HTTP response to an endpoint's parsed request, served as `served_as` (None:
        the base model)."""
        job = self.validate(request, served_as)
        job.request_state = raw_request.state
        streams = await self.add_requests(job.prompts, job.params.n)
        if request.stream:
            return EventStreamResponse(
                self.stream_events(job, streams), on_close=lambda: self.abort(streams)
            )
        try:
            response = await self.wait_for_response(job, streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    async def wait_for_response(self, job: ServingJob, streams: list[RequestStream],
                                raw_request: Request) -> BaseModel:
        """The whole response (the endpoint's response model) once every stream finished;
        ClientDisconnected if the client left first, OpenAIError for an engine failure or
        a timeout. The streams are aborted however it ends."""
        try:
            outputs = await run_until_disconnect(
                raw_request, with_deadline(final_outputs(streams), self.request_timeout))
        except (EngineDeadError, EngineStepError) as e:
            raise engine_error(e) from None
        except RequestTimeout as e:
            await self.abort_and_wait(streams)
            raise e.error() from None
        finally:
            self.abort(streams)
        response = self.response(job, outputs)
        leave_usage(job, response.usage)
        return response

    def validate(self, request, served_as: ServedAs | None = None) -> ServingJob:
        """Every check a request passes before the engine sees it, served as `served_as`
        (None: the base model); raises InvalidRequestError (or OpenAIError) for the first
        that fails."""
        served_as = served_as or self.base()
        check_model(request.model, served_as)
        request.field_policy.warn_ignored(request)  # one line naming them, if any
        for param, message in request.unsupported_fields():
            raise InvalidRequestError(message, param, "unsupported_parameter")
        fields = self.sampling_fields(request)
        params = self.sampling_params(request, fields)
        inputs = self.build_prompts(request)
        request_id = f"{self.request_id_prefix}-{uuid.uuid4().hex}"
        try:
            prompts = [
                self.engine.input_processor.process(
                    request_id if len(inputs) == 1 else f"{request_id}-{i}",
                    prompt.text if prompt.token_ids is None else (prompt.text or prompt.token_ids),
                    params,
                    prompt_token_ids=prompt.token_ids,
                    priority=request.priority or 0,
                    # (the server's default cap yields to the room the prompt leaves)
                    reject_over_length=fields.max_tokens is not None,
                    prompt_param=prompt.param,
                    max_tokens_param=fields.name_of("max_tokens"),
                    lora_request=served_as.lora_request,
                )
                for i, prompt in enumerate(inputs)
            ]
        except InvalidRequestError as e:
            # e.g. the grammar engine refusing a schema names "structured_outputs"; the
            # client may have sent it as response_format or guided_json.
            if e.param is None or fields.name_of(e.param) == e.param:
                raise
            raise e.renamed(fields.name_of(e.param)) from None
        return ServingJob(request, request_id, params, prompts, served_as=served_as)

    def sampling_params(
        self, request: SamplingRequestFields, fields: SamplingFields
    ) -> SamplingParams:
        """SamplingParams from the request; errors name the field as this endpoint does."""
        n = 1 if request.n is None else request.n  # bounded by SamplingParams (MAX_N)
        logit_bias = None
        if request.logit_bias is not None:
            logit_bias = {}
            for key, bias in request.logit_bias.items():
                try:
                    logit_bias[int(key)] = bias
                except ValueError:
                    raise InvalidRequestError.about(
                        "logit_bias", f"keys must be token ids (integers as strings), got {key!r}"
                    ) from None
        try:
            return SamplingParams(
                n=n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if request.repetition_penalty is None else request.repetition_penalty
                ),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=bool(request.ignore_eos),
                max_tokens=self.max_tokens(request, fields),
                min_tokens=request.min_tokens or 0,
                logprobs=fields.logprobs,
                prompt_logprobs=fields.prompt_logprobs,
                include_stop_str_in_output=bool(request.include_stop_str_in_output),
                skip_special_tokens=(
                    True if request.skip_special_tokens is None else request.skip_special_tokens
                ),
                logit_bias=logit_bias,
                structured_outputs=fields.structured_outputs,
            )
        except InvalidRequestError as e:
            if e.param is None:
                raise
            raise e.renamed(fields.name_of(e.param)) from None

    def max_tokens(self, request: SamplingRequestFields, fields: SamplingFields) -> int | None:
        """The request's own cap, else the server's default (at least min_tokens)."""
        if fields.max_tokens is not None or self.default_max_tokens is None:
            return fields.max_tokens
        return max(self.default_max_tokens, request.min_tokens or 0)

    async def add_requests(self, prompts: list[EngineRequest], n: int) -> list[RequestStream]:
        """Hand the validated requests to the engine; if one is refused, abort the others."""
        self.check_queue(n * len(prompts))
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                streams.append(await self.engine.add_request(prompt))
        except BaseException as e:
            self.abort(streams)
            if isinstance(e, QueueFullError):
                raise server_overloaded(str(e)) from None
            if isinstance(e, EngineDeadError):
                raise server_error(str(e), HTTPStatus.SERVICE_UNAVAILABLE) from None
            raise
        return streams

    def check_queue(self, num_seqs: int) -> None:
        try:
            self.engine.check_queue(num_seqs)
        except QueueFullError as e:
            raise server_overloaded(str(e)) from None

    async def abort_and_wait(self, streams: list[RequestStream]) -> None:
        """Abort, then wait until the engine has released the requests (none running or
        waiting, their KV blocks free, its snapshot and /metrics saying so): a 408 goes out
        only once nothing of its request is left (the data parallel engine's replicas do not
        acknowledge aborts: its synchronize returns at once)."""
        self.abort(streams)
        await self.engine.synchronize()

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    # ---- responses ---------------------------------------------------------------------------

    def response(self, job: ServingJob, outputs: list[RequestOutput]) -> BaseModel:
        n = job.params.n
        choices = [
            self.response_choice(job, i, output, completion, i * n + completion.index)
            for i, output in enumerate(outputs)
            for completion in output.outputs
        ]
        num_completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return self.response_type(
            id=job.request_id, model=job.model_name, choices=choices,
            usage=self.usage(job, num_completion_tokens),
        )

    async def stream_events(
        self, job: ServingJob, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        """The SSE body: a chunk per choice delta, the usage chunk if asked, then [DONE]."""
        exclude = None if job.request.include_usage else {"usage"}
        async with aclosing(self.stream_chunks(job, streams)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, OpenAIError):
                    yield sse_error(chunk)
                else:
                    yield sse(chunk.model_dump_json(exclude=exclude))
        yield SSE_DONE

    async def stream_chunks(
        self, job: ServingJob, streams: list[RequestStream]
    ) -> AsyncIterator[BaseModel | OpenAIError]:
        """The stream as objects: a chunk (the endpoint's chunk model) per choice delta, the
        usage chunk if the request asks for it, and last, if the engine fails or the request
        times out, the error. The streams are aborted however it ends (close it with
        `contextlib.aclosing`)."""
        n = job.params.n
        states = [self.choice_state_type(index) for index in range(len(streams) * n)]

        def so_far() -> UsageInfo | None:  # (usage in every chunk: continuous_usage_stats)
            return (self.usage(job, sum(s.num_tokens for s in states))
                    if job.request.continuous_usage else None)

        try:
            for choice in self.opening_choices(job):
                yield self.chunk(job, [choice], usage=so_far())
            async for i, output in until_deadline(merge_streams(streams), self.request_timeout):
                for completion in output.outputs:
                    state = states[i * n + completion.index]
                    if state.finished:
                        continue
                    state.num_tokens = len(completion.token_ids)
                    choices = self.stream_choice(job, state, i, output, completion)
                    if choices is None:
                        continue
                    state.finished = completion.finished
                    for choice in choices if isinstance(choices, list) else [choices]:
                        yield self.chunk(job, [choice], usage=so_far())
            if job.request.include_usage:
                usage = self.usage(job, sum(s.num_tokens for s in states))
                yield self.chunk(job, [], usage=usage)
        except (EngineDeadError, EngineStepError) as e:
            yield engine_error(e)
        except RequestTimeout as e:
            await self.abort_and_wait(streams)
            yield e.error()
        finally:
            self.abort(streams)
            leave_usage(job, self.usage(job, sum(s.num_tokens for s in states)))

    def chunk(self, job: ServingJob, choices: list[BaseModel],
              usage: UsageInfo | None = None) -> BaseModel:
        return self.chunk_type(id=job.request_id, created=job.created, model=job.model_name,
                               choices=choices, usage=usage)

    @staticmethod
    def usage(job: ServingJob, num_completion_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=job.num_prompt_tokens,
                         completion_tokens=num_completion_tokens,
                         total_tokens=job.num_prompt_tokens + num_completion_tokens)


def check_model(model: str | None, served_as: ServedAs) -> None:
    """A request that names a model must name the one it is served as."""
    if model is not None and model != served_as.model_name:
        raise model_not_found(model)


def leave_usage(job: ServingJob, usage: UsageInfo) -> None:
    if job.request_state is not None:
        setattr(job.request_state, USAGE_STATE, usage)


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def engine_error(error: BaseException) -> OpenAIError:
    """An engine failure met after the request was accepted (not the client's fault)."""
    if isinstance(error, EngineDeadError):
        return server_error(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(error, EngineStepError):
        return server_error(str(error))
    return server_error(f"Internal server error: {type(error).__name__}: {error}")

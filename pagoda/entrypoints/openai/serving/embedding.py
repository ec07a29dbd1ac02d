"""POST /v1/embeddings: one pooling request per input through the engine, one vector each.

    EmbeddingRequest ─ check model ─ PoolingParams ─ InputProcessor.process_pooling per input
    (tokenize, context length, `dimensions` against the model: 400s naming the field)
    ─ queue check ─ add every input to the engine (batched by the scheduler with whatever
    else runs, prefill only) ─ wait for the last outputs (499 if the client leaves, 408 past
    --request-timeout) ─ OpenAI's list of embeddings, floats or base64, with usage.

Whatever happens, unfinished engine requests are aborted (their KV blocks freed).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from http import HTTPStatus

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.loop.protocol import EngineClient
from pagoda.engine.loop.request_stream import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from pagoda.entrypoints.openai.protocol.embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagoda.entrypoints.openai.protocol.errors import server_error, server_overloaded
from pagoda.entrypoints.openai.serving.guards import RequestTimeout, with_deadline
from pagoda.entrypoints.openai.serving.job import ServedAs
from pagoda.entrypoints.openai.serving.pipeline import check_model, engine_error
from pagoda.entrypoints.openai.serving.streaming import (
    ClientDisconnected,
    final_outputs,
    run_until_disconnect,
)
from pagoda.errors import InvalidRequestError
from pagoda.pooling_params import PoolingParams

INPUT_PARAM = "input"


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding:
    request_id_prefix = "embd"

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        """`engine`: the model's engine front-end (input_processor, check_queue,
        add_request, abort: pagoda/engine/loop/protocol.py)."""
        self.engine = engine
        self.model_name = model_name
        self.request_timeout: float | None = None
        """Seconds a request may run before it is stopped with 408 (--request-timeout)."""

    async def serve(self, request: EmbeddingRequest, raw_request: Request,
                    served_as: ServedAs | None = None) -> Response:
        """The response, served as `served_as` (an adapter; None: the base model)."""
        served_as = served_as or ServedAs(self.model_name)
        prompts = self.validate(request, served_as)
        streams = await self.add_requests(prompts)
        try:
            outputs = await run_until_disconnect(
                raw_request, with_deadline(final_outputs(streams), self.request_timeout))
        except ClientDisconnected:
            return Response(status_code=499)
        except (EngineDeadError, EngineStepError) as e:
            raise engine_error(e) from None
        except RequestTimeout as e:
            self.abort(streams)
            await self.engine.synchronize()  # (the 408 goes once nothing of it is left)
            raise e.error() from None
        finally:
            self.abort(streams)
        data = []
        for index, output in enumerate(outputs):
            vector = output.embedding
            if vector is None:  # ended without its vector: aborted by the engine
                raise server_error(f"input {index} ended without an embedding "
                                   f"({output.outputs[0].finish_reason})")
            embedding = encode_base64(vector) if request.encoding_format == "base64" else vector
            data.append(EmbeddingData(index=index, embedding=embedding))
        num_tokens = sum(len(p.prompt_token_ids) for p in prompts)
        response = EmbeddingResponse(
            data=data, model=served_as.model_name,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())

    def validate(self, request: EmbeddingRequest,
                 served_as: ServedAs | None = None) -> list[EngineRequest]:
        """Every check before the engine sees the request; InvalidRequestError (a 400
        naming the field) for the first that fails."""
        served_as = served_as or ServedAs(self.model_name)
        check_model(request.model, served_as)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        inputs = request.inputs()
        request_id = f"{self.request_id_prefix}-{uuid.uuid4().hex}"
        prompts = []
        for i, value in enumerate(inputs):
            name = INPUT_PARAM if len(inputs) == 1 else f"{INPUT_PARAM}[{i}]"
            try:
                prompts.append(self.engine.input_processor.process_pooling(
                    request_id if len(inputs) == 1 else f"{request_id}-{i}", value, params,
                    prompt_param=name, lora_request=served_as.lora_request))
            except InvalidRequestError as e:
                if e.param == name and name != INPUT_PARAM:
                    raise e.renamed(INPUT_PARAM) from None  # (the message names the item)
                raise
        return prompts

    async def add_requests(self, prompts: list[EngineRequest]) -> list[RequestStream]:
        """Hand the inputs to the engine, all at once (the engine loop takes the whole batch
        of adds between two steps: one at a time, a request of 2048 inputs would wait 2048
        steps before its first vector); if one is refused, abort the others."""
        try:
            self.engine.check_queue(len(prompts))
        except QueueFullError as e:
            raise server_overloaded(str(e)) from None
        added = asyncio.gather(*(self.engine.add_request(p) for p in prompts),
                               return_exceptions=True)
        try:
            results = await added
        except BaseException:  # cancelled (the client left): abort whatever was added
            for prompt in prompts:
                self.engine.abort(prompt.request_id)
            raise
        streams = [r for r in results if isinstance(r, RequestStream)]
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            self.abort(streams)
            if isinstance(error, QueueFullError):
                raise server_overloaded(str(error)) from None
            if isinstance(error, EngineDeadError):
                raise server_error(str(error), HTTPStatus.SERVICE_UNAVAILABLE) from None
            raise error
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

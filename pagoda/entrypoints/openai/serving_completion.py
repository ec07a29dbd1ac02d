"""POST /v1/completions: prompts as text or token ids, echo, legacy logprobs, streaming.

Each prompt of a request is its own engine request (`{id}-{i}`); choice `i * n + j` is
choice j of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.request_stream import EngineDeadError, EngineStepError, RequestStream
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from pagoda.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    OpenAIServing,
    clamp_logprob,
    engine_error,
    final_outputs,
    merge_streams,
    run_until_disconnect,
    sse,
    sse_error,
)
from pagoda.outputs import TokenLogprobDict
from pagoda.sampling_params import SamplingParams


class Prompt:
    def __init__(self, text: str | None, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        for param, message in request.unsupported_fields():
            raise bad_request(message, param=param, code="unsupported_parameter")
        prompts = self._prompts(request.prompt)
        echo_logprobs = request.logprobs if request.echo else None
        params = self.sampling_params(request, request.max_tokens, request.logprobs,
                                      prompt_logprobs=echo_logprobs)
        for prompt in prompts:
            self.check_context_length(len(prompt.token_ids), request.max_tokens, "prompt", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_requests(
            [(f"{request_id}-{i}", p.token_ids, params) for i, p in enumerate(prompts)],
            request.priority or 0,
        )
        if request.stream:
            return EventStreamResponse(
                self._stream(request, request_id, prompts, params, streams),
                on_close=lambda: self.abort(streams),
            )
        try:
            outputs = await run_until_disconnect(raw_request, final_outputs(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        except (EngineDeadError, EngineStepError) as e:
            raise engine_error(e) from None
        finally:
            self.abort(streams)
        choices = []
        num_completion_tokens = 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            for completion in output.outputs:
                token_ids, logprob_dicts = completion.token_ids, completion.logprobs or []
                text = completion.text
                if request.echo:
                    text = self._echo_text(prompt) + text
                    token_ids = prompt.token_ids + token_ids
                    logprob_dicts = self._prompt_logprobs(output, prompt) + logprob_dicts
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = self.logprobs(token_ids, logprob_dicts, 0)
                choices.append(CompletionResponseChoice(
                    index=i * params.n + completion.index, text=text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                ))
                num_completion_tokens += len(completion.token_ids)
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        response = CompletionResponse(
            id=request_id, model=self.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens,
                            completion_tokens=num_completion_tokens,
                            total_tokens=num_prompt_tokens + num_completion_tokens),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
        params: SamplingParams, streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = params.n
        num_choices = len(prompts) * n
        echo_pending = [bool(request.echo)] * num_choices
        text_offsets = [0] * num_choices
        finished = [False] * num_choices
        num_tokens = [0] * num_choices
        exclude = None if request.include_usage else {"usage"}
        try:
            async for i, output in merge_streams(streams):
                prompt = prompts[i]
                for completion in output.outputs:
                    index = i * n + completion.index
                    if finished[index]:
                        continue
                    num_tokens[index] = len(completion.token_ids)
                    text = completion.delta_text
                    token_ids = completion.delta_token_ids
                    logprob_dicts = completion.delta_logprobs or []
                    if echo_pending[index]:
                        if not completion.token_ids and not completion.finished:
                            continue  # prompt logprobs are complete with the first token
                        echo_pending[index] = False
                        text = self._echo_text(prompt) + text
                        token_ids = prompt.token_ids + token_ids
                        logprob_dicts = self._prompt_logprobs(output, prompt) + logprob_dicts
                    if not text and not token_ids and not completion.finished:
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs, text_offsets[index] = self.logprobs(
                            token_ids, logprob_dicts, text_offsets[index]
                        )
                    finished[index] = completion.finished
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionResponseChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )],
                    )
                    yield sse(chunk.model_dump_json(exclude=exclude))
            if request.include_usage:
                num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
                usage = UsageInfo(prompt_tokens=num_prompt_tokens,
                                  completion_tokens=sum(num_tokens),
                                  total_tokens=num_prompt_tokens + sum(num_tokens))
                chunk = CompletionResponse(id=request_id, created=created, model=self.model_name,
                                           choices=[], usage=usage)
                yield sse(chunk.model_dump_json())
        except (EngineDeadError, EngineStepError) as e:
            yield sse_error(engine_error(e))
        finally:
            self.abort(streams)
        yield SSE_DONE

    # ---- helpers -------------------------------------------------------------------------------

    def _prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str):
            prompts = [Prompt(prompt, self.tokenizer.encode(prompt))]
        elif isinstance(prompt[0], str):
            prompts = [Prompt(p, self.tokenizer.encode(p)) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [Prompt(None, list(prompt))]
        else:
            prompts = [Prompt(None, list(p)) for p in prompt]
        for i, p in enumerate(prompts):
            self.check_prompt_token_ids(p.token_ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        return prompts

    def _echo_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    @staticmethod
    def _prompt_logprobs(output, prompt: Prompt) -> list[TokenLogprobDict | None]:
        logprobs = list(output.prompt_logprobs or [])
        return logprobs + [None] * (len(prompt.token_ids) - len(logprobs))

    def logprobs(
        self, token_ids: list[int], logprob_dicts: list[TokenLogprobDict | None], text_offset: int
    ) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy shape; returns it and the text offset after its last token.

        `top_logprobs` holds the sampled token and the requested alternatives (so up to
        logprobs + 1 entries, as OpenAI documents); a prompt's first token has no logprob."""
        result = CompletionLogProbs()
        for token_id, position in zip(token_ids, logprob_dicts):
            if position is None:
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = position.get(token_id) or next(iter(position.values()))
                token = chosen.decoded_token or ""
                result.token_logprobs.append(clamp_logprob(chosen.logprob))
                result.top_logprobs.append(
                    {lp.decoded_token or "": clamp_logprob(lp.logprob) for lp in position.values()}
                )
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset

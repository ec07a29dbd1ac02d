"""POST /v1/chat/completions: messages -> chat template -> tokens -> one engine request.

The prompt is built exactly as the offline `LLM.chat` builds it (template text, then the
`encode_chat_prompt`), so a greedy chat answer here equals the offline one. Streams send
one `chat.completion.chunk` per choice with `{"role": "assistant", "content": ""}` first,
then content deltas; the last delta of a choice carries its finish_reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.request_stream import EngineDeadError, EngineStepError, RequestStream
from pagoda.entrypoints.llm import apply_chat_template, encode_chat_prompt
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
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
    run_until_disconnect,
    sse,
    sse_error,
)
from pagoda.outputs import TokenLogprobDict
from pagoda.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None = None
    ) -> None:
        super().__init__(engine, model_name)
        self.chat_template = chat_template

    def render_prompt(
        self, messages: list[ChatMessage], chat_template: str | None,
        add_generation_prompt: bool,
    ) -> str:
        """The conversation as prompt text; 400 for what the template cannot render."""
        conversation = []
        for message in messages:
            # "developer" is OpenAI's newer name for "system"; templates know "system".
            role = "system" if message.role == "developer" else message.role
            entry = {"role": role, "content": message.text()}
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        try:
            return apply_chat_template(
                self.tokenizer, conversation, chat_template or self.chat_template,
                add_generation_prompt,
            )
        except (ValueError, jinja2.TemplateError) as e:
            raise bad_request(f"messages: cannot apply the chat template: {e}",
                              param="messages") from None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self.check_model(request.model)
        for param, message in request.unsupported_fields():
            raise bad_request(message, param=param, code="unsupported_parameter")
        max_tokens, max_tokens_param = request.requested_max_tokens
        logprobs = None
        if request.logprobs:
            logprobs = request.top_logprobs or 0
        params = self.sampling_params(
            request, max_tokens, logprobs,
            renamed={"max_tokens": max_tokens_param, "logprobs": "top_logprobs"},
        )
        add_generation_prompt = (
            True if request.add_generation_prompt is None else request.add_generation_prompt
        )
        prompt = self.render_prompt(request.messages, request.chat_template, add_generation_prompt)
        prompt_token_ids = encode_chat_prompt(self.tokenizer, prompt)
        self.check_prompt_token_ids(prompt_token_ids, "messages")
        self.check_context_length(len(prompt_token_ids), max_tokens, "messages", "messages",
                                  max_tokens_param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [stream] = await self.add_requests(
            [(request_id, prompt_token_ids, params)], request.priority or 0
        )
        if request.stream:
            return EventStreamResponse(
                self._stream(request, request_id, len(prompt_token_ids), params, stream),
                on_close=lambda: self.abort([stream]),
            )
        try:
            [output] = await run_until_disconnect(raw_request, final_outputs([stream]))
        except ClientDisconnected:
            return Response(status_code=499)
        except (EngineDeadError, EngineStepError) as e:
            raise engine_error(e) from None
        finally:
            self.abort([stream])
        choices = [
            ChatCompletionResponseChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, params),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in output.outputs
        ]
        num_prompt_tokens = len(output.prompt_token_ids)
        num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        response = ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens,
                            completion_tokens=num_completion_tokens,
                            total_tokens=num_prompt_tokens + num_completion_tokens),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
        params: SamplingParams, stream: RequestStream,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        exclude = None if request.include_usage else {"usage"}

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            payload = ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=[choice]
            )
            return sse(payload.model_dump_json(exclude=exclude))

        finished = [False] * params.n
        num_tokens = [0] * params.n
        try:
            for index in range(params.n):
                yield chunk(ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content="")
                ))
            async for output in stream:
                for completion in output.outputs:
                    index = completion.index
                    if finished[index]:
                        continue
                    num_tokens[index] = len(completion.token_ids)
                    text = completion.delta_text
                    if not text and not completion.delta_token_ids and not completion.finished:
                        continue
                    finished[index] = completion.finished
                    yield chunk(ChatCompletionStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=text or None),
                        logprobs=self._logprobs(
                            completion.delta_token_ids, completion.delta_logprobs, params
                        ),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    ))
            if request.include_usage:
                total = num_prompt_tokens + sum(num_tokens)
                usage = ChatCompletionChunk(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=UsageInfo(prompt_tokens=num_prompt_tokens,
                                    completion_tokens=sum(num_tokens), total_tokens=total),
                )
                yield sse(usage.model_dump_json())
        except (EngineDeadError, EngineStepError) as e:
            yield sse_error(engine_error(e))
        finally:
            self.abort([stream])
        yield SSE_DONE

    def _logprobs(
        self, token_ids: list[int], logprob_dicts: list[TokenLogprobDict] | None,
        params: SamplingParams,
    ) -> ChatChoiceLogProbs | None:
        """OpenAI's chat shape: per token its logprob, UTF-8 bytes and exactly `top_logprobs`
        alternatives by rank (the sampled token among them only if it ranks that high)."""
        if params.logprobs is None:
            return None
        content = []
        for token_id, position in zip(token_ids, logprob_dicts or []):
            chosen = position.get(token_id) or next(iter(position.values()))
            top = sorted(
                (lp for lp in position.values() if lp.rank is not None
                 and lp.rank <= params.logprobs),
                key=lambda lp: lp.rank,
            )
            content.append(ChatLogProbsContent(
                token=chosen.decoded_token or "",
                logprob=clamp_logprob(chosen.logprob),
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[
                    ChatLogProb(token=lp.decoded_token or "", logprob=clamp_logprob(lp.logprob),
                                bytes=list((lp.decoded_token or "").encode()))
                    for lp in top[: params.logprobs]
                ],
            ))
        return ChatChoiceLogProbs(content=content)

"""POST /v1/chat/completions: messages -> chat template -> tokens -> one engine request.

What chat supplies to the serving pipeline (serving_pipeline.py): the prompt, built exactly
as the offline `LLM.chat` builds it (template text, then `encode_chat_prompt`), so a greedy
chat answer here equals the offline one; its field names (`max_completion_tokens`,
`top_logprobs`); and its shapes. Streams send one `chat.completion.chunk` per choice with
`{"role": "assistant", "content": ""}` first, then content deltas; the last delta of a choice
carries its finish_reason.
"""

from __future__ import annotations

import jinja2

from pagoda.entrypoints.chat_template import apply_chat_template, encode_chat_prompt
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
)
from pagoda.entrypoints.openai.serving_pipeline import (
    ChoiceState,
    PromptInput,
    SamplingFields,
    ServingJob,
    ServingPipeline,
    clamp_logprob,
)
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput, TokenLogprobDict


class OpenAIServingChat(ServingPipeline):
    request_id_prefix = "chatcmpl"
    response_type = ChatCompletionResponse
    chunk_type = ChatCompletionChunk

    def __init__(self, engine, model_name: str, chat_template: str | None = None) -> None:
        super().__init__(engine, model_name)
        self.chat_template = chat_template

    def render_prompt(
        self, messages: list[ChatMessage], chat_template: str | None,
        add_generation_prompt: bool,
    ) -> str:
        """The conversation as prompt text; InvalidRequestError for what the template
        cannot render."""
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
            raise InvalidRequestError(f"messages: cannot apply the chat template: {e}",
                                      "messages") from None

    # ---- what chat supplies to the pipeline --------------------------------------------------

    def sampling_fields(self, request: ChatCompletionRequest) -> SamplingFields:
        max_tokens, max_tokens_param = request.requested_max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return SamplingFields(
            max_tokens, logprobs,
            field_names={"max_tokens": max_tokens_param, "logprobs": "top_logprobs"},
        )

    def build_prompts(self, request: ChatCompletionRequest) -> list[PromptInput]:
        add_generation_prompt = request.add_generation_prompt is not False
        text = self.render_prompt(request.messages, request.chat_template, add_generation_prompt)
        return [PromptInput(text, encode_chat_prompt(self.tokenizer, text), "messages")]

    def response_choice(
        self, job: ServingJob, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput, index: int,
    ) -> ChatCompletionResponseChoice:
        return ChatCompletionResponseChoice(
            index=index,
            message=ChatResponseMessage(content=completion.text),
            logprobs=self.logprobs(completion.token_ids, completion.logprobs, job.params.logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def opening_choices(self, job: ServingJob) -> list[ChatCompletionStreamChoice]:
        return [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(job.params.n)
        ]

    def stream_choice(
        self, job: ServingJob, state: ChoiceState, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput,
    ) -> ChatCompletionStreamChoice | None:
        text = completion.delta_text
        if not text and not completion.delta_token_ids and not completion.finished:
            return None
        return ChatCompletionStreamChoice(
            index=state.index,
            delta=DeltaMessage(content=text or None),
            logprobs=self.logprobs(
                completion.delta_token_ids, completion.delta_logprobs, job.params.logprobs
            ),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    @staticmethod
    def logprobs(
        token_ids: list[int], logprob_dicts: list[TokenLogprobDict] | None,
        num_top: int | None,
    ) -> ChatChoiceLogProbs | None:
        """OpenAI's chat shape: per token its logprob, UTF-8 bytes and exactly `num_top`
        (the request's top_logprobs) alternatives by rank, the sampled token among them only
        if it ranks that high. None when the request did not ask for logprobs."""
        if num_top is None:
            return None
        content = []
        for token_id, position in zip(token_ids, logprob_dicts or []):
            chosen = position.get(token_id) or next(iter(position.values()))
            top = sorted(
                (lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top),
                key=lambda lp: lp.rank,
            )
            content.append(ChatLogProbsContent(
                token=chosen.decoded_token or "",
                logprob=clamp_logprob(chosen.logprob),
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[
                    ChatLogProb(token=lp.decoded_token or "", logprob=clamp_logprob(lp.logprob),
                                bytes=list((lp.decoded_token or "").encode()))
                    for lp in top[:num_top]
                ],
            ))
        return ChatChoiceLogProbs(content=content)

"""POST /v1/chat/completions: messages -> chat template -> tokens -> one engine request.

What chat supplies to the serving pipeline (serving/pipeline.py): the prompt, built exactly
as the offline `LLM.chat` builds it (template text, then `encode_chat_prompt`), so a greedy
chat answer here equals the offline one; its field names (`max_completion_tokens`,
`top_logprobs`); and its shapes. Streams send one `chat.completion.chunk` per choice with
`{"role": "assistant", "content": ""}` first, then content deltas; the last delta of a choice
carries its finish_reason. Tools (serving/tools.py): the prompt lists them, "required" or a
named tool_choice constrains the output to calls, and the output's calls become
`message.tool_calls` (streamed: `delta.tool_calls` fragments, one per chunk). Reasoning
(serving/reasoning.py, with --reasoning-parser): the thinking is split off first, into
`message.reasoning_content` (streamed: `delta.reasoning_content` chunks); only the rest is
content and read for calls, and a constraint applies only after the thinking. vLLM's
`echo`, `prompt_logprobs` (on the response) and `return_tokens_as_token_ids` are
vllm_extras.py's.
"""

from __future__ import annotations

import jinja2

from pagoda.entrypoints.chat_template import encode_chat_prompt
from pagoda.entrypoints.openai.protocol.requests import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.protocol.responses import (
    ChatChoiceLogProbs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    DeltaMessage,
)
from pagoda.entrypoints.openai.protocol.structured_fields import structured_outputs_of
from pagoda.entrypoints.openai.serving.job import PromptInput, SamplingFields, ServingJob
from pagoda.entrypoints.openai.serving.pipeline import ServingPipeline, clamp_logprob
from pagoda.entrypoints.openai.serving.reasoning import (
    ReasoningChoiceState,
    chat_reasoning_parser,
    constrain_after_reasoning,
    keep_reasoning_special_tokens,
    new_reasoning_parser,
    split_output,
)
from pagoda.entrypoints.openai.serving.tools import (
    check_tool_schemas,
    constrain_to_calls,
    conversation_of,
    delta_messages,
    finish_reason,
    keep_special_tokens,
    new_parser,
    plan_of,
    response_calls,
)
from pagoda.entrypoints.openai.serving.vllm_extras import (
    echo_prefix,
    prompt_logprobs_json,
    token_label,
)
from pagoda.entrypoints.tools.parsers import parse_output
from pagoda.entrypoints.tools.rendering import render_chat
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput, TokenLogprobDict


class OpenAIServingChat(ServingPipeline):
    request_id_prefix = "chatcmpl"
    response_type = ChatCompletionResponse
    chunk_type = ChatCompletionChunk
    choice_state_type = ReasoningChoiceState

    def __init__(self, engine, model_name: str, chat_template: str | None = None,
                 tool_call_parser: str = "hermes", reasoning_parser: str | None = None) -> None:
        super().__init__(engine, model_name)
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        """The parser of "auto" tool calls (tools/parsers/ TOOL_PARSERS; already resolved
        from "auto" by resolve_tool_call_parser)."""
        self.reasoning_parser = chat_reasoning_parser(
            reasoning_parser, chat_template or getattr(self.tokenizer, "chat_template", None),
            model_name)
        """The reasoning parser (reasoning/parsers.py REASONING_PARSERS; "auto" resolved);
        None: the output is all content."""

    def render_prompt(
        self, messages: list[ChatMessage], chat_template: str | None,
        add_generation_prompt: bool, tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The conversation (and the tools offered) as prompt text; InvalidRequestError for
        what the template cannot render. `template_kwargs`: the request's
        (ChatTemplateFields.template_kwargs)."""
        conversation = conversation_of(messages)
        try:
            return render_chat(
                self.tokenizer, conversation, tools, chat_template or self.chat_template,
                add_generation_prompt, template_kwargs=template_kwargs,
            )
        except (ValueError, jinja2.TemplateError) as e:
            raise InvalidRequestError(f"messages: cannot apply the chat template: {e}",
                                      "messages") from None
        except Exception as e:  # noqa: BLE001 -- a template is code the request may supply
            # (e.g. `{% include %}`, which has no loader here: TypeError): its error, a 400
            raise InvalidRequestError(f"messages: cannot apply the chat template: "
                                      f"{type(e).__name__}: {e}", "messages") from None

    # ---- what chat supplies to the pipeline --------------------------------------------------

    def sampling_fields(self, request: ChatCompletionRequest) -> SamplingFields:
        max_tokens, max_tokens_param = request.requested_max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        structured_outputs, structured_param = structured_outputs_of(request)
        fields = SamplingFields(
            max_tokens, logprobs, request.prompt_logprobs, structured_outputs=structured_outputs,
            field_names={"max_tokens": max_tokens_param, "logprobs": "top_logprobs",
                         "structured_outputs": structured_param},
        )
        plan = plan_of(request)
        check_tool_schemas(plan, getattr(self.engine.input_processor, "grammar_compiler", None))
        constrain_to_calls(plan, fields)
        keep_special_tokens(plan, self.tool_call_parser, request)
        keep_reasoning_special_tokens(self.reasoning_parser, request)
        constrain_after_reasoning(self.reasoning_parser, fields)
        return fields

    def build_prompts(self, request: ChatCompletionRequest) -> list[PromptInput]:
        add_generation_prompt = request.add_generation_prompt is not False
        plan = plan_of(request)
        tools = list(plan.tools) if plan.offers_tools else None
        text = self.render_prompt(request.messages, request.chat_template, add_generation_prompt,
                                  tools, request.template_kwargs())
        return [PromptInput(text, encode_chat_prompt(self.tokenizer, text), "messages")]

    def response_choice(
        self, job: ServingJob, prompt_index: int, output: RequestOutput,
        completion: CompletionOutput, index: int,
    ) -> ChatCompletionResponseChoice:
        split = split_output(self.reasoning_parser, completion.text)
        # Content "" (as without a parser) unless the output was reasoning, then null.
        text = split.content or ("" if split.reasoning is None else None)
        message = ChatResponseMessage(content=text, reasoning_content=split.reasoning)
        reason = completion.finish_reason
        plan = plan_of(job.request)
        if plan.offers_tools:
            parsed = parse_output(new_parser(plan, self.tool_call_parser), text or "")
            message = ChatResponseMessage(content=parsed.content,
                                          tool_calls=response_calls(parsed),
                                          reasoning_content=split.reasoning)
            reason = finish_reason(reason, bool(parsed.tool_calls))
        echoed = echo_prefix(job.request)
        if echoed:
            message.content = echoed + (message.content or "")
        return ChatCompletionResponseChoice(
            index=index,
            message=message,
            logprobs=self.logprobs(completion.token_ids, completion.logprobs, job.params.logprobs,
                                   job.request.return_tokens_as_token_ids),
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )

    def response(self, job: ServingJob, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        response = super().response(job, outputs)
        if job.request.prompt_logprobs is not None:  # vLLM's extra, on the response
            response.prompt_logprobs = prompt_logprobs_json(
                outputs[0], job.num_prompt_tokens, job.request.prompt_logprobs)
        return response

    def opening_choices(self, job: ServingJob) -> list[ChatCompletionStreamChoice]:
        """The role deltas, then (echo) the continued assistant message's text."""
        choices = [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(job.params.n)
        ]
        echoed = echo_prefix(job.request)
        if echoed:
            choices += [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echoed))
                        for i in range(job.params.n)]
        return choices

    def stream_choice(
        self, job: ServingJob, state: ReasoningChoiceState, prompt_index: int,
        output: RequestOutput, completion: CompletionOutput,
    ) -> list[ChatCompletionStreamChoice] | None:
        """A delta through the choice's parsers: reasoning first (a chunk of its own), then
        the content, read for calls when tools are offered. Text a parser holds back sends
        nothing (an empty delta still carries logprobs); logprobs go with the first chunk,
        the finish_reason with the last."""
        logprobs = self.logprobs(
            completion.delta_token_ids, completion.delta_logprobs, job.params.logprobs,
            job.request.return_tokens_as_token_ids,
        )
        if not state.tools_planned:
            state.tools_planned = True
            plan = plan_of(job.request)
            if plan.offers_tools:
                state.parser = new_parser(plan, self.tool_call_parser)
            state.reasoning = new_reasoning_parser(self.reasoning_parser)
        text, messages = completion.delta_text, []
        if state.reasoning is not None:
            split = state.reasoning.feed(text)
            if completion.finished:
                split.extend(state.reasoning.finish())
            text = split.content
            if split.reasoning:
                messages.append(DeltaMessage(reasoning_content=split.reasoning))
        if state.parser is not None:
            delta = state.parser.feed(text)
            if completion.finished:
                delta.extend(state.parser.finish())
            if delta:
                messages.extend(delta_messages(delta))
        elif text:
            messages.append(DeltaMessage(content=text))
        if not messages:
            holding = state.parser is not None or state.reasoning is not None
            if not completion.finished and not (
                    completion.delta_token_ids and (logprobs is not None or not holding)):
                return None
            messages.append(DeltaMessage())
        choices = [ChatCompletionStreamChoice(index=state.index, delta=message)
                   for message in messages]
        choices[0].logprobs = logprobs
        if completion.finished:
            made_calls = state.parser is not None and state.parser.num_calls > 0
            choices[-1].finish_reason = finish_reason(completion.finish_reason, made_calls)
            choices[-1].stop_reason = completion.stop_reason
        return choices

    @staticmethod
    def logprobs(
        token_ids: list[int], logprob_dicts: list[TokenLogprobDict] | None,
        num_top: int | None, as_token_ids: bool | None = False,
    ) -> ChatChoiceLogProbs | None:
        """OpenAI's chat shape: per token its logprob, UTF-8 bytes and exactly `num_top`
        (the request's top_logprobs) alternatives by rank, the sampled token among them only
        if it ranks that high. None when the request did not ask for logprobs. With
        `as_token_ids` (return_tokens_as_token_ids) tokens read "token_id:N" and the bytes
        are that text's, as vLLM writes them."""
        if num_top is None:
            return None
        content = []
        for token_id, position in zip(token_ids, logprob_dicts or []):
            chosen_id = token_id if token_id in position else next(iter(position))
            top = sorted(
                ((alt_id, lp) for alt_id, lp in position.items()
                 if lp.rank is not None and lp.rank <= num_top),
                key=lambda item: item[1].rank,
            )
            token = token_label(chosen_id, position[chosen_id], bool(as_token_ids))
            content.append(ChatLogProbsContent(
                token=token,
                logprob=clamp_logprob(position[chosen_id].logprob),
                bytes=list(token.encode()),
                top_logprobs=[
                    ChatLogProb(token=(alt := token_label(alt_id, lp, bool(as_token_ids))),
                                logprob=clamp_logprob(lp.logprob), bytes=list(alt.encode()))
                    for alt_id, lp in top[:num_top]
                ],
            ))
        return ChatChoiceLogProbs(content=content)

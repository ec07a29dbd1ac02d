"""A chat answer as Responses output items, whole (this file) or streamed (events.py), with
one rule for both:

    reasoning_content      -> a `reasoning` item first (reasoning models)
    content                -> a `message` item with one `output_text` part; left out when it
                              is only whitespace and the answer has calls or reasoning
    tool_calls             -> one `function_call` item each, in order
    finish_reason "length" -> the last item and the response are "incomplete"
                              (incomplete_details.reason "max_output_tokens")

An answer with none of these is one empty message, so `output_text` is always there.
"""

from __future__ import annotations

from collections.abc import Callable

from pagoda.entrypoints.openai.protocol.responses import ChatChoiceLogProbs, ChatCompletionResponse
from pagoda.entrypoints.openai.responses_api.objects import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputTextPart,
    ReasoningItem,
    ReasoningTextPart,
    ResponseUsage,
)


def reasoning_of(message_or_delta) -> str | None:
    """Chat's reasoning text, when a reasoning parser split it off (`reasoning_content`)."""
    return getattr(message_or_delta, "reasoning_content", None)


def logprob_entries(logprobs: ChatChoiceLogProbs | None) -> list[dict]:
    """Chat's logprobs as output_text's: per token {token, logprob, bytes, top_logprobs}
    (the same fields)."""
    if logprobs is None or not logprobs.content:
        return []
    return [entry.model_dump() for entry in logprobs.content]


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(chat_response: ChatCompletionResponse, wants_logprobs: bool) -> list[OutputItem]:
    """The items of a whole chat answer (one choice)."""
    choice = chat_response.choices[0]
    message = choice.message
    reasoning = reasoning_of(message)
    calls = message.tool_calls or []
    content = message.content or ""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(content=[ReasoningTextPart(text=reasoning)]))
    if content.strip() or not (calls or reasoning):
        logprobs = logprob_entries(choice.logprobs) if wants_logprobs else []
        items.append(MessageItem(content=[OutputTextPart(text=content, logprobs=logprobs)]))
    items += [FunctionCallItem(call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments) for call in calls]
    items[-1].status = status_of(choice.finish_reason)
    return items


def usage_of(input_tokens: int, output_tokens: int, reasoning: str,
             count_tokens: Callable[[str], int]) -> ResponseUsage:
    usage = ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                          total_tokens=input_tokens + output_tokens)
    if reasoning:
        usage.output_tokens_details.reasoning_tokens = min(count_tokens(reasoning),
                                                           output_tokens)
    return usage

"""Chat chunks -> the Responses stream events, numbered by `sequence_number` from 0.

    response.created, response.in_progress                        (the response, in_progress)
    per output item, in order (output.py's rule):
      reasoning  output_item.added, content_part.added (reasoning_text),
                 reasoning_text.delta ..., reasoning_text.done, content_part.done,
                 output_item.done
      message    output_item.added, content_part.added (output_text),
                 output_text.delta ..., output_text.done, content_part.done,
                 output_item.done
      call       output_item.added (function_call, arguments ""),
                 function_call_arguments.delta ..., function_call_arguments.done,
                 output_item.done
    response.completed | response.incomplete (cut at max_output_tokens) | response.failed

An item opens on its first delta and closes when the next one opens or the answer ends.
Whitespace before a message's first text is held back: it opens the message only if text
follows or the answer has nothing else (a whole answer drops it the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.entrypoints.openai.protocol.errors import OpenAIError
from pagoda.entrypoints.openai.protocol.responses import ChatCompletionChunk
from pagoda.entrypoints.openai.responses_api.objects import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputTextPart,
    ReasoningItem,
    ReasoningTextPart,
    Response,
    ResponseErrorInfo,
    ResponseUsage,
)
from pagoda.entrypoints.openai.responses_api.output import (
    logprob_entries,
    reasoning_of,
    status_of,
    usage_of,
)


class ResponseEvents:
    def __init__(self, response: Response, wants_logprobs: bool,
                 count_tokens: Callable[[str], int]) -> None:
        """`response`: the in-progress response; its `output` grows as items open."""
        self.response = response
        self.wants_logprobs = wants_logprobs
        self.count_tokens = count_tokens
        self.sequence_number = 0
        self.open_item: OutputItem | None = None
        """The item receiving deltas (the last of response.output), or None."""
        self.pending_space = ""
        self.pending_logprobs: list[dict] = []
        self.calls: dict[int, FunctionCallItem] = {}
        """Chat's call index -> its item."""
        self.finish_reason: str | None = None
        self.usage: tuple[int, int] = (0, 0)
        """(input tokens, output tokens) from chat's usage chunk."""

    # ---- events ---------------------------------------------------------------------------

    def event(self, type: str, **fields: Any) -> dict:
        event = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def item_event(self, type: str, of: OutputItem, **fields: Any) -> dict:
        """An event about the output item `of` (its item_id and output_index)."""
        output_index = next(i for i, x in enumerate(self.response.output) if x is of)
        return self.event(type, item_id=of.id, output_index=output_index, **fields)

    def opening(self) -> list[dict]:
        snapshot = self.response.model_dump()
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def on_chunk(self, chunk: ChatCompletionChunk) -> list[dict]:
        if chunk.usage is not None:
            self.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        events: list[dict] = []
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = reasoning_of(delta)
            if reasoning:
                events += self.reasoning_delta(reasoning)
            if delta.content:
                logprobs = logprob_entries(choice.logprobs) if self.wants_logprobs else []
                events += self.text_delta(delta.content, logprobs)
            for fragment in delta.tool_calls or []:
                events += self.call_fragment(fragment)
            self.finish_reason = choice.finish_reason or self.finish_reason
        return events

    def closing(self) -> list[dict]:
        """The last events of an answer that ended: the open item closed, then
        response.completed or response.incomplete."""
        events = []
        if not self.response.output:  # nothing but (perhaps) whitespace
            events += self.open(MessageItem(content=[]))
            events += self.text_delta("", [])
        status = status_of(self.finish_reason)
        events += self.close(status)
        reasoning = "".join(part.text for item in self.response.output
                            if isinstance(item, ReasoningItem) for part in item.content)
        self.response.finish(status, usage_of(*self.usage, reasoning, self.count_tokens))
        return events + [self.event(f"response.{status}", response=self.response.model_dump())]

    def failed(self, error: OpenAIError) -> list[dict]:
        """response.failed: the engine failed or the request timed out; the output so far
        is kept, its open item incomplete."""
        if self.open_item is not None:
            self.open_item.status = "incomplete"
            self.open_item = None
        self.response.error = ResponseErrorInfo(code=error.code or "server_error",
                                                message=error.message)
        self.response.finish("failed", ResponseUsage(
            input_tokens=self.usage[0], output_tokens=self.usage[1],
            total_tokens=sum(self.usage)))
        return [self.event("response.failed", response=self.response.model_dump())]

    # ---- items ----------------------------------------------------------------------------

    def open(self, item: OutputItem) -> list[dict]:
        events = self.close("completed")
        item.status = "in_progress"
        self.response.output.append(item)
        self.open_item = item
        events.append(self.item_event("response.output_item.added", item,
                                      item=item.model_dump()))
        events[-1].pop("item_id")  # output_item.added carries the item itself
        if isinstance(item, MessageItem):
            events.append(self.item_event("response.content_part.added", item, content_index=0,
                                          part=OutputTextPart(text="").model_dump()))
            item.content.append(OutputTextPart(text=""))
        elif isinstance(item, ReasoningItem):
            events.append(self.item_event("response.content_part.added", item, content_index=0,
                                          part=ReasoningTextPart(text="").model_dump()))
            item.content.append(ReasoningTextPart(text=""))
        return events

    def close(self, status: str) -> list[dict]:
        item = self.open_item
        if item is None:
            return []
        self.open_item = None
        item.status = status
        events = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            events.append(self.item_event("response.output_text.done", item, content_index=0,
                                          text=part.text, logprobs=part.logprobs))
            events.append(self.item_event("response.content_part.done", item, content_index=0,
                                          part=part.model_dump()))
        elif isinstance(item, ReasoningItem):
            part = item.content[0]
            events.append(self.item_event("response.reasoning_text.done", item,
                                          content_index=0, text=part.text))
            events.append(self.item_event("response.content_part.done", item, content_index=0,
                                          part=part.model_dump()))
        else:
            events.append(self.item_event("response.function_call_arguments.done", item,
                                          name=item.name, arguments=item.arguments))
        events.append(self.item_event("response.output_item.done", item, item=item.model_dump()))
        events[-1].pop("item_id")
        return events

    def reasoning_delta(self, text: str) -> list[dict]:
        events = []
        if not isinstance(self.open_item, ReasoningItem):
            events += self.open(ReasoningItem())
        item = self.open_item
        item.content[0].text += text
        events.append(self.item_event("response.reasoning_text.delta", item, content_index=0,
                                      delta=text))
        return events

    def text_delta(self, text: str, logprobs: list[dict]) -> list[dict]:
        events = []
        if not isinstance(self.open_item, MessageItem):
            if not text.strip():
                self.pending_space += text
                self.pending_logprobs += logprobs
                return []
            events += self.open(MessageItem())
        text, self.pending_space = self.pending_space + text, ""
        logprobs, self.pending_logprobs = self.pending_logprobs + logprobs, []
        part = self.open_item.content[0]
        part.text += text
        part.logprobs += logprobs
        if text:
            events.append(self.item_event("response.output_text.delta", self.open_item,
                                          content_index=0, delta=text, logprobs=logprobs))
        return events

    def call_fragment(self, fragment) -> list[dict]:
        """A chat call fragment: the first of a call (id and name) opens its item, the
        next ones are its argument text."""
        events = []
        if fragment.id is not None:
            self.pending_space, self.pending_logprobs = "", []
            item = FunctionCallItem(call_id=fragment.id, name=fragment.function.name)
            self.calls[fragment.index] = item
            events += self.open(item)
        arguments = fragment.function.arguments if fragment.function is not None else None
        if arguments:
            item = self.calls[fragment.index]
            item.arguments += arguments
            events.append(self.item_event("response.function_call_arguments.delta", item,
                                          delta=arguments))
        return events

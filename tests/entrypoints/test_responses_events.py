"""Chat answers as Responses output, whole (output.py) and streamed (events.py), checked with
the openai SDK's own models (strict validation, so a missing or misnamed field fails): the
documented event sequence with sequence numbers from 0, reasoning / message / function_call
items in order, deltas that join to the final text and arguments, whitespace held back, the
streamed final response equal to the whole one, "incomplete" when cut, "failed" on errors."""

from __future__ import annotations

import pytest
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from pagoda.entrypoints.openai.protocol.errors import server_error
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
    UsageInfo,
)
from pagoda.entrypoints.openai.protocol.tool_fields import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagoda.entrypoints.openai.responses_api.events import ResponseEvents
from pagoda.entrypoints.openai.responses_api.objects import Response
from pagoda.entrypoints.openai.responses_api.output import output_items

EVENT = TypeAdapter(ResponseStreamEvent)


def count_words(text: str) -> int:
    return len(text.split())


def chunk(delta: DeltaMessage | None = None, finish_reason: str | None = None,
          usage: UsageInfo | None = None, logprobs: ChatChoiceLogProbs | None = None
          ) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatCompletionStreamChoice(
        index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]
    return ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=choices,
                               usage=usage)


def call_chunks(index: int, call_id: str, name: str, pieces: list[str]) -> list:
    first = DeltaToolCall(index=index, id=call_id, type="function",
                          function=DeltaFunctionCall(name=name, arguments=""))
    rest = [DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece))
            for piece in pieces]
    return [chunk(DeltaMessage(tool_calls=[fragment])) for fragment in [first, *rest]]


def run(chunks: list, wants_logprobs: bool = False) -> list[dict]:
    """The events of `chunks`, each validated as the SDK's event type."""
    events = ResponseEvents(Response(model="m"), wants_logprobs, count_words)
    out = events.opening()
    for c in chunks:
        out += events.on_chunk(c)
    out += events.closing()
    for event in out:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def types(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def without_ids(items: list) -> list[dict]:
    dumps = [item if isinstance(item, dict) else item.model_dump() for item in items]
    return [{k: v for k, v in item.items() if k != "id"} for item in dumps]


USAGE = UsageInfo(prompt_tokens=7, completion_tokens=9, total_tokens=16)


def test_a_text_answer_streams_the_documented_sequence_and_joins_to_its_text():
    events = run([chunk(DeltaMessage(role="assistant", content="")),
                  chunk(DeltaMessage(content="Hello")), chunk(DeltaMessage(content=" world")),
                  chunk(DeltaMessage(), finish_reason="stop"), chunk(usage=USAGE)])
    assert types(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "completed"]
    assert events[0]["response"]["status"] == "in_progress"
    item_id = events[2]["item"]["id"]
    assert events[2]["item"] == {"id": item_id, "type": "message", "role": "assistant",
                                 "status": "in_progress", "content": []}
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in deltas} == {
        (item_id, 0, 0)}
    assert "".join(e["delta"] for e in deltas) == "Hello world" == events[6]["text"]
    final = SDKResponse.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello world"
    assert final.output[0].status == "completed" and final.completed_at is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        7, 9, 16)


def test_reasoning_then_text_then_calls_in_order_and_equal_to_the_whole_answer():
    stream = [chunk(DeltaMessage(role="assistant", content="")),
              chunk(DeltaMessage(reasoning_content="Think ")),
              chunk(DeltaMessage(reasoning_content="twice.")),
              chunk(DeltaMessage(content="\n\n")),  # whitespace before the text: held back
              chunk(DeltaMessage(content="Checking.")),
              *call_chunks(0, "call_a", "get_weather", ['{"city": ', '"Paris"}']),
              *call_chunks(1, "call_b", "get_time", ['{"zone": "CET"}']),
              chunk(DeltaMessage(), finish_reason="tool_calls"), chunk(usage=USAGE)]
    events = run(stream)
    assert types(events) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done", "completed"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[6]["text"] == "Think twice."
    assert events[11]["delta"] == "\n\nChecking."  # the held whitespace goes with the text
    assert events[15]["item"]["type"] == "function_call" and events[15]["output_index"] == 2
    assert events[15]["item"]["arguments"] == "" and events[15]["item"]["call_id"] == "call_a"
    assert events[18] | {"sequence_number": 0, "item_id": ""} == {
        "type": "response.function_call_arguments.done", "sequence_number": 0, "item_id": "",
        "output_index": 2, "name": "get_weather", "arguments": '{"city": "Paris"}'}
    final = SDKResponse.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    assert final.output[0].content[0].text == "Think twice."
    assert final.usage.output_tokens_details.reasoning_tokens == 2  # count_words

    whole = ChatCompletionResponse(id="chatcmpl-1", model="m", usage=USAGE, choices=[
        ChatCompletionResponseChoice(index=0, finish_reason="tool_calls", message=(
            ChatResponseMessage(content="\n\nChecking.", reasoning_content="Think twice.",
                                tool_calls=[
                                    ToolCall(id="call_a", function=FunctionCall(
                                        name="get_weather", arguments='{"city": "Paris"}')),
                                    ToolCall(id="call_b", function=FunctionCall(
                                        name="get_time", arguments='{"zone": "CET"}'))])))])
    assert without_ids(output_items(whole, False)) == without_ids(events[-1]["response"]["output"])


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_whitespace_before_calls_is_dropped_and_an_empty_answer_is_one_empty_message(
        finish_reason):
    events = run([chunk(DeltaMessage(content=" \n")),
                  *call_chunks(0, "call_a", "f", ["{}"]),
                  chunk(DeltaMessage(), finish_reason=finish_reason)])
    final = SDKResponse.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["function_call"]
    events = run([chunk(DeltaMessage(content="")), chunk(DeltaMessage(content=" ")),
                  chunk(DeltaMessage(), finish_reason=finish_reason)])
    final = SDKResponse.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["message"] and final.output_text == " "
    assert types(events)[-1] == ("completed" if finish_reason == "stop" else "incomplete")
    whole = ChatCompletionResponse(id="c", model="m", usage=USAGE, choices=[
        ChatCompletionResponseChoice(index=0, finish_reason=finish_reason,
                                     message=ChatResponseMessage(content=" "))])
    assert without_ids(output_items(whole, False)) == without_ids(events[-1]["response"]["output"])


def test_a_cut_answer_is_incomplete_with_its_reason():
    events = run([chunk(DeltaMessage(content="To be")),
                  chunk(DeltaMessage(content=" cut"), finish_reason="length"),
                  chunk(usage=USAGE)])
    assert types(events)[-1] == "incomplete"
    final = SDKResponse.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.completed_at is None
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["status"] == "incomplete"


def test_logprobs_go_with_their_deltas_when_asked():
    logprobs = ChatChoiceLogProbs(content=[ChatLogProbsContent(
        token="Hi", logprob=-0.5, bytes=[72, 105],
        top_logprobs=[ChatLogProb(token="Hi", logprob=-0.5, bytes=[72, 105])])])
    stream = [chunk(DeltaMessage(content="Hi"), logprobs=logprobs),
              chunk(DeltaMessage(), finish_reason="stop")]
    events = run(stream, wants_logprobs=True)
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                  "top_logprobs": [{"token": "Hi", "logprob": -0.5,
                                                    "bytes": [72, 105]}]}]
    final = SDKResponse.model_validate(events[-1]["response"])
    assert final.output[0].content[0].logprobs[0].token == "Hi"
    events = run(stream, wants_logprobs=False)
    assert next(e for e in events if e["type"] == "response.output_text.delta")["logprobs"] == []


def test_an_engine_failure_ends_the_stream_with_response_failed():
    events = ResponseEvents(Response(model="m"), False, count_words)
    out = events.opening() + events.on_chunk(chunk(DeltaMessage(content="Part")))
    out += events.failed(server_error("the engine failed while running this request"))
    for event in out:
        EVENT.validate_python(event)
    assert types(out)[-1] == "failed"
    final = SDKResponse.model_validate(out[-1]["response"])
    assert final.status == "failed" and final.error.code == "server_error"
    assert "engine failed" in final.error.message
    assert final.output[0].status == "incomplete" and final.output_text == "Part"

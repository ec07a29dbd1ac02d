"""POST /v1/responses on the chat pipeline, and the stored responses' routes.

    request ── checks ── previous_response_id: the stored conversation (404 if gone)
       └─ to_chat.py: the chat request ── OpenAIServingChat.validate (the one validation;
          errors renamed to the Responses fields; truncation "auto" drops the oldest items
          until the prompt fits) ── the engine
             ├─ wait: chat's whole answer ── output.py ── the Response
             └─ stream: chat's chunk objects ── events.py ── `event: <type>` / `data: {...}`
       └─ store: true ── the store (store.py), before the last event or the response goes out

Every stored response keeps the conversation a follow-up continues, so a chain outlives the
responses it started from (until its own entry expires).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.protocol.errors import OpenAIError, bad_request
from pagoda.entrypoints.openai.responses_api.events import ResponseEvents
from pagoda.entrypoints.openai.responses_api.input_items import (
    InputFunctionCall,
    InputFunctionCallOutput,
    InputMessage,
    InputReasoning,
)
from pagoda.entrypoints.openai.responses_api.objects import (
    DeletedResponse,
    FunctionCallItem,
    InputItemList,
    MessageItem,
    ReasoningItem,
    new_id,
)
from pagoda.entrypoints.openai.responses_api.objects import Response as ResponseObject
from pagoda.entrypoints.openai.responses_api.output import (
    output_items,
    reasoning_of,
    status_of,
    usage_of,
)
from pagoda.entrypoints.openai.responses_api.protocol import (
    IGNORED_FIELDS,
    FunctionChoice,
    ResponsesRequest,
)
from pagoda.entrypoints.openai.responses_api.store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.responses_api.to_chat import (
    CHAT_TAKES_REASONING_EFFORT,
    PREVIOUS_PARAM,
    chat_conversion,
    own_items,
    responses_error,
)
from pagoda.entrypoints.openai.serving.chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving.job import ServedAs, ServingJob
from pagoda.entrypoints.openai.serving.streaming import ClientDisconnected, EventStreamResponse
from pagoda.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_INPUT_ITEMS_PAGE = 100


class OpenAIServingResponses:
    """One request's Responses API, on the chat endpoint of the model it names, served as
    `served_as` (an adapter over that model; None: the model itself)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore,
                 served_as: ServedAs | None = None) -> None:
        self.chat = chat
        self.store = store
        self.served_as = served_as or chat.base()

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        for param, message in request.unsupported_fields():
            raise InvalidRequestError(message, param, "unsupported_parameter")
        ignored = [name for name in IGNORED_FIELDS if getattr(request, name) is not None
                   and not (name == "reasoning" and CHAT_TAKES_REASONING_EFFORT)]
        if ignored:
            logger.warning("responses: ignored fields (no meaning here): %s", ", ".join(ignored))
        previous = self.previous(request.previous_response_id)
        earlier = previous.conversation if previous is not None else []
        items = own_items(request)
        job = self.validate(request, earlier, items)
        job.request_state = raw_request.state
        streams = await self.chat.add_requests(job.prompts, 1)
        response = new_response(request, job.model_name)
        if request.stream:
            events = ResponseEvents(response, request.wants_logprobs, self.count_tokens)
            return EventStreamResponse(
                self.stream(job, streams, events, request, earlier + items, items),
                on_close=lambda: self.chat.abort(streams))
        try:
            chat_response = await self.chat.wait_for_response(job, streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        response.output = output_items(chat_response, request.wants_logprobs)
        reasoning = reasoning_of(chat_response.choices[0].message) or ""
        response.finish(status_of(chat_response.choices[0].finish_reason),
                        usage_of(chat_response.usage.prompt_tokens,
                                 chat_response.usage.completion_tokens, reasoning,
                                 self.count_tokens))
        self.remember(request, earlier + items, items, response)
        return JSONResponse(response.model_dump())

    def previous(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"Previous response with id '{response_id}' not found.", 404,
                              "invalid_request_error", PREVIOUS_PARAM,
                              "previous_response_not_found")
        return stored

    def validate(self, request: ResponsesRequest, earlier: list, items: list) -> ServingJob:
        """Chat's validation of the conversation `earlier + items`; with truncation "auto",
        of its shortest tail that fits (fewest items dropped, found by bisection)."""
        params = [PREVIOUS_PARAM] * len(earlier) + [f"input[{i}]" for i in range(len(items))]
        conversation = earlier + items

        def attempt(num_dropped: int) -> ServingJob:
            kept = kept_indices(conversation, num_dropped)
            conversion = chat_conversion(request, [conversation[i] for i in kept],
                                         [params[i] for i in kept])
            try:
                return self.chat.validate(conversion.request, self.served_as)
            except InvalidRequestError as e:
                raise responses_error(e, conversion) from None

        try:
            return attempt(0)
        except InvalidRequestError as e:
            if request.truncation != "auto" or e.code != "context_length_exceeded":
                raise
            error = e
        # Dropping more never makes the prompt longer: the fewest that fit, by bisection
        # (the last item always stays).
        low, high, job = 1, len(conversation) - 1, None
        while low <= high:
            middle = (low + high) // 2
            try:
                job = attempt(middle)
                high = middle - 1
            except InvalidRequestError as e:
                if e.code != "context_length_exceeded":
                    raise
                low = middle + 1
        if job is None:
            raise error
        return job

    async def stream(self, job: ServingJob, streams: list, events: ResponseEvents,
                     request: ResponsesRequest, conversation: list, items: list
                     ) -> AsyncIterator[str]:
        for event in events.opening():
            yield sse_event(event)
        async with aclosing(self.chat.stream_chunks(job, streams)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, OpenAIError):
                    last = events.failed(chunk)
                    self.remember(request, conversation, items, events.response)
                    for event in last:
                        yield sse_event(event)
                    return
                for event in events.on_chunk(chunk):
                    yield sse_event(event)
        last = events.closing()
        self.remember(request, conversation, items, events.response)
        for event in last:
            yield sse_event(event)

    def remember(self, request: ResponsesRequest, conversation: list, items: list,
                 response: ResponseObject) -> None:
        if request.store is False:
            return
        self.store.put(StoredResponse(
            response=response, conversation=conversation + continued_items(response.output),
            input_items=[listed_item(item) for item in items]))

    def count_tokens(self, text: str) -> int:
        return len(self.chat.tokenizer.encode(text, add_special_tokens=False))


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def new_response(request: ResponsesRequest, model_name: str) -> ResponseObject:
    """The in-progress response, echoing the request's settings (OpenAI's defaults where it
    left them out)."""
    text: dict = {"format": {"type": "text"}, "verbosity": "medium"}
    if request.text is not None:
        if request.text.format is not None:
            text["format"] = request.text.format.model_dump(by_alias=True, exclude_none=True)
        text["verbosity"] = request.text.verbosity or "medium"
    tool_choice = request.tool_choice if request.tool_choice is not None else "auto"
    if isinstance(tool_choice, FunctionChoice):
        tool_choice = tool_choice.model_dump()
    reasoning = {"effort": None, "summary": None}
    if request.reasoning is not None:
        reasoning = {"effort": request.reasoning.effort,
                     "summary": request.reasoning.summary or request.reasoning.generate_summary}
    return ResponseObject(
        model=model_name, instructions=request.instructions,
        max_output_tokens=request.max_output_tokens, max_tool_calls=request.max_tool_calls,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id, reasoning=reasoning,
        store=request.store is not False,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p, text=text,
        tool_choice=tool_choice, top_logprobs=request.top_logprobs or 0,
        tools=[{"type": "function", "name": t.name, "description": t.description,
                "parameters": t.parameters, "strict": t.strict} for t in request.tools or []],
        truncation=request.truncation or "disabled", user=request.user,
        metadata=request.metadata or {},
    )


def kept_indices(conversation: list, num_dropped: int) -> list[int]:
    """The items left after dropping the first `num_dropped`, less the
    function_call_output items that answer a dropped call."""
    dropped_calls = {item.call_id for item in conversation[:num_dropped]
                     if isinstance(item, InputFunctionCall)}
    return [i for i in range(num_dropped, len(conversation))
            if not (isinstance(conversation[i], InputFunctionCallOutput)
                    and conversation[i].call_id in dropped_calls)]


def continued_items(output: list) -> list:
    """A response's output as the input items of a follow-up."""
    items = []
    for item in output:
        if isinstance(item, MessageItem):
            items.append(InputMessage(role="assistant", id=item.id, status=item.status,
                                      content="".join(part.text for part in item.content)))
        elif isinstance(item, FunctionCallItem):
            items.append(InputFunctionCall(type="function_call", id=item.id, status=item.status,
                                      call_id=item.call_id, name=item.name,
                                      arguments=item.arguments))
        elif isinstance(item, ReasoningItem):
            items.append(InputReasoning(type="reasoning", id=item.id, status=item.status,
                                        content=[part.model_dump() for part in item.content]))
    return items


def listed_item(item) -> dict:
    """An input item as GET .../input_items lists it: with an id and a status, a message's
    content as parts."""
    if isinstance(item, InputMessage):
        content = item.content
        if isinstance(content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": kind, "text": content}]
        else:
            content = [part.model_dump(exclude_none=True) for part in content]
        return {"id": item.id or new_id("msg"), "type": "message", "role": item.role,
                "status": item.status or "completed", "content": content}
    listed = item.model_dump(exclude_none=True)
    prefix = {"function_call": "fc", "function_call_output": "fco"}.get(listed["type"], "rs")
    listed.setdefault("id", new_id(prefix))
    listed.setdefault("status", "completed")
    return listed


# ---- the stored responses' routes ------------------------------------------------------------


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404,
                       "invalid_request_error", "response_id", "response_not_found")


def retrieve(store: ResponseStore, response_id: str) -> JSONResponse:
    stored = store.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.response.model_dump())


def delete(store: ResponseStore, response_id: str) -> JSONResponse:
    if not store.delete(response_id):
        raise not_found(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


def list_input_items(store: ResponseStore, response_id: str, query) -> JSONResponse:
    """A page of the input items: `limit` (1 to 100, default 20), `order` ("desc", the
    default, or "asc"), `after` (an item id: the page starts after it)."""
    stored = store.get(response_id)
    if stored is None:
        raise not_found(response_id)
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
        raise bad_request(f"limit: must be an integer in [1, {MAX_INPUT_ITEMS_PAGE}], got "
                          f"{query.get('limit')!r}", param="limit", code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", param="order",
                          code="invalid_value")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise bad_request(f"after: no input item of this response has id "
                              f"{query['after']!r}", param="after", code="invalid_value")
        start = ids.index(query["after"]) + 1
    page = items[start:start + limit]
    return JSONResponse(InputItemList(
        data=page, first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=start + limit < len(items)).model_dump())

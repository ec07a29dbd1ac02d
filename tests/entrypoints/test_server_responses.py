"""The Responses API through `pagoda serve` on the bundled model, with the clients that call
it: the openai SDK (`responses.create` plain, streamed, structured, a function-tool round
trip; the store's routes, its bound and expiry as the flags set them; bad input) and the
OpenAI Agents SDK running an agent with one function tool. A greedy response equals the greedy
chat answer to the same messages: the Responses API runs on the chat pipeline."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai
import pytest

from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

STORE_SIZE = 3
STORE_TTL_S = 6.0
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "strict": True, "parameters": {
               "type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 16}}}}
QUESTION = "What is the weather like in Paris today?"
GREEDY = {"model": MODEL_NAME, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--responses-store-size", str(STORE_SIZE),
                       "--responses-store-ttl", str(STORE_TTL_S)]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_answer_with_usage(client):
    response = client.responses.create(input="What is the capital of France?",
                                       max_output_tokens=24, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, **GREEDY)
    assert response.output_text.strip() and response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens,
                                                         chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.model == MODEL_NAME and response.temperature == 0


def test_a_streamed_response_sends_the_documented_events(client):
    request = {"input": "Write one sentence about the sea.", "max_output_tokens": 20, **GREEDY}
    whole = client.responses.create(**request)
    events = list(client.responses.create(stream=True, **request))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    response = client.responses.create(
        input="Invent a person: give a name and an age.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}}, **GREEDY)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_function_tool_round_trip(client, tool_choice):
    first = client.responses.create(input=QUESTION, tools=[WEATHER], tool_choice=tool_choice,
                                    parallel_tool_calls=False, max_output_tokens=60, **GREEDY)
    assert first.status == "completed"
    [call] = calls_of(first)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # right away: the server keeps responses STORE_TTL_S seconds
    answer = client.responses.create(
        previous_response_id=first.id, tools=[WEATHER], max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 22, "sky": "sunny"})}], **GREEDY)
    assert answer.previous_response_id == first.id
    assert answer.output[0].type == "message" and answer.output_text.strip()
    # the call and its result were in the prompt: more input than the first turn's
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    events = list(client.responses.create(
        input=QUESTION, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
        max_output_tokens=60, stream=True, **GREEDY))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and done.name == "get_weather"
    [streamed] = calls_of(events[-1].response)
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def test_the_store_holds_the_newest_responses_until_they_expire(client):
    first = client.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Hi")]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    ids = [client.responses.create(input=f"Count to {i}.", max_output_tokens=2, **GREEDY).id
           for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):  # the oldest went first
        client.responses.retrieve(ids[0])
    for response_id in ids[1:]:
        client.responses.retrieve(response_id)
    time.sleep(STORE_TTL_S + 0.5)
    for response_id in ids[1:]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(input="More", previous_response_id=ids[-1], **GREEDY)
    assert error.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(("request_fields", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input[0].call_id"),
    ({"input": "x", "max_output_tokens": 4096}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "object", "minProperties": "x"}}}},
     "text.format"),
])
def test_bad_input_is_a_400_naming_the_field(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": MODEL_NAME, **request_fields})
    assert error.value.body["param"] == param, error.value.body


def test_an_openai_agents_sdk_agent_calls_its_tool(server):
    import agents  # the OpenAI Agents SDK (a test extra); imported here: it is slow to load
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}, 22 C"

    async def run() -> tuple:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer weather questions with the tool.",
            model=OpenAIResponsesModel(MODEL_NAME, client), tools=[get_weather],
            tool_use_behavior="stop_on_first_tool",
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                max_tokens=60, parallel_tool_calls=False))
        result = await agents.Runner.run(agent, QUESTION)
        streamed = agents.Runner.run_streamed(agent, QUESTION)
        kinds = [event.type async for event in streamed.stream_events()]
        await client.close()
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(run())
    assert len(cities) == 2 and cities[0] == cities[1] and cities[0]
    assert result.final_output == f"Sunny in {cities[0]}, 22 C" == streamed.final_output
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem",
                                                                  "ToolCallOutputItem"]
    assert "raw_response_event" in kinds

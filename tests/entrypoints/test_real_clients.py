"""The client libraries people point at an OpenAI URL, unchanged, against a real `pagoda serve`
on the bundled model (issue 34, part 7: chat and completions): LangChain's ChatOpenAI
(invoke, stream, with_structured_output by JSON schema and by function calling, bind_tools
with a forced call), LlamaIndex's OpenAILike (complete and chat; chat and completions
models) and instructor (JSON_SCHEMA and TOOLS modes). Each test checks the answer's shape
(types, fields, parsed objects) and, where greedy decoding allows, that the client got the
same answer as the openai SDK sending the same request by hand. Also vLLM's extras as
users send them (the openai SDK's `extra_body`) on the real model: chat `echo`,
`return_tokens_as_token_ids`, `prompt_logprobs`.

litellm is not covered: the package registry this project installs from does not serve it.
"""

from __future__ import annotations

import json

import httpx
import instructor
import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_openai import ChatOpenAI
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
)
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel, Field

from tests.entrypoints.server_helpers import MODEL_NAME, SHARED_API_KEY

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 64
"""Enough for a forced call of the schemas below to end by itself."""


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SHARED_API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_model(server) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key=SHARED_API_KEY, model=MODEL_NAME,
                      temperature=0, seed=7, max_tokens=MAX_TOKENS, max_retries=0)


def sdk_answer(sdk: openai.OpenAI, content: str) -> str:
    response = sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        seed=7, max_tokens=MAX_TOKENS)
    return response.choices[0].message.content


# ---- LangChain ----------------------------------------------------------------------------


def test_langchain_invoke_and_stream(chat_model, sdk) -> None:
    answer = chat_model.invoke([HumanMessage(QUESTION)])
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.content and answer.content == sdk_answer(sdk, QUESTION)
    assert answer.response_metadata["finish_reason"] == "stop"
    assert answer.response_metadata["model_name"] == MODEL_NAME
    usage = answer.usage_metadata
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    chunks = list(chat_model.stream(QUESTION))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == answer.content  # greedy: the stream is the same answer
    assert whole.response_metadata["finish_reason"] == "stop"


def test_langchain_structured_output_by_json_schema(chat_model) -> None:
    structured = chat_model.with_structured_output(City, method="json_schema", include_raw=True)
    result = structured.invoke("Name a city in France.")
    assert result["parsing_error"] is None
    city = result["parsed"]
    assert isinstance(city, City) and city.name and city.country
    assert json.loads(result["raw"].content) == city.model_dump()


def test_langchain_structured_output_by_function_calling(chat_model) -> None:
    """A named tool_choice: exactly one call, finish_reason tool_calls (as OpenAI answers)."""
    structured = chat_model.with_structured_output(City, method="function_calling",
                                                   include_raw=True)
    result = structured.invoke("Name a city in France.")
    assert result["parsing_error"] is None
    city = result["parsed"]
    assert isinstance(city, City) and city.name and city.country
    raw = result["raw"]
    assert [call["name"] for call in raw.tool_calls] == ["City"]
    assert raw.tool_calls[0]["args"] == city.model_dump()
    assert raw.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_bind_tools_with_a_forced_call(chat_model) -> None:
    forced = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    answer = forced.invoke("What is the weather like in Paris?")
    assert isinstance(answer, AIMessage) and not answer.invalid_tool_calls
    assert len(answer.tool_calls) == 1, answer.tool_calls  # OpenAI makes one forced call
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and call["type"] == "tool_call"
    assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    assert get_weather.__name__ == call["name"]  # the call runs the bound function
    assert get_weather(**call["args"]).startswith("sunny in ")


# ---- LlamaIndex ---------------------------------------------------------------------------


def llama_index(server, is_chat_model: bool, max_tokens: int = MAX_TOKENS) -> OpenAILike:
    return OpenAILike(model=MODEL_NAME, api_base=server.url + "/v1", api_key=SHARED_API_KEY,
                      is_chat_model=is_chat_model, temperature=0, max_tokens=max_tokens,
                      additional_kwargs={"seed": 7}, max_retries=0)


def test_llama_index_chat_model_complete_and_chat(server, sdk) -> None:
    llm = llama_index(server, is_chat_model=True)
    completion = llm.complete(QUESTION)
    assert isinstance(completion, CompletionResponse)
    assert completion.text == sdk_answer(sdk, QUESTION)  # went through /v1/chat/completions
    assert isinstance(completion.raw, openai.types.chat.ChatCompletion)

    chat = llm.chat([ChatMessage(role=MessageRole.USER, content=QUESTION)])
    assert isinstance(chat, ChatResponse)
    assert chat.message.role == MessageRole.ASSISTANT
    assert chat.message.content == completion.text
    assert chat.raw.usage.completion_tokens > 0

    deltas = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=QUESTION)]))
    assert len(deltas) > 2
    assert "".join(d.delta or "" for d in deltas) == deltas[-1].message.content == chat.message.content


def test_llama_index_completions_model(server, sdk) -> None:
    llm = llama_index(server, is_chat_model=False, max_tokens=8)
    completion = llm.complete("The capital of France is")
    assert isinstance(completion, CompletionResponse)
    assert isinstance(completion.raw, openai.types.Completion)  # went through /v1/completions
    expected = sdk.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                      max_tokens=8, temperature=0, seed=7)
    assert completion.text == expected.choices[0].text and completion.text


# ---- instructor ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_response_model(server, mode) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key=SHARED_API_KEY, max_retries=0),
        mode=mode)
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL_NAME, response_model=City, max_retries=0, temperature=0, seed=7,
        max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Name a city in France."}])
    assert isinstance(city, City) and city.name and city.country
    message = completion.choices[0].message
    if mode == instructor.Mode.TOOLS:  # a named tool_choice: one call of the model's schema
        assert [call.function.name for call in message.tool_calls] == ["City"]
        assert json.loads(message.tool_calls[0].function.arguments) == city.model_dump()
        assert completion.choices[0].finish_reason == "tool_calls"
    else:
        assert json.loads(message.content) == city.model_dump()
        assert completion.choices[0].finish_reason == "stop"


# ---- vLLM's extras through the openai SDK -------------------------------------------------


def test_chat_echo_continues_the_assistant_message(sdk) -> None:
    started = "The capital of France is"
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": started}]
    request = {"model": MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 12}
    plain = sdk.chat.completions.create(**request).choices[0].message.content
    echoed = sdk.chat.completions.create(**request, extra_body={"echo": True})
    assert echoed.choices[0].message.content == started + plain
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       sdk.chat.completions.create(**request, stream=True,
                                                   extra_body={"echo": True}))
    assert streamed == started + plain


def test_return_tokens_as_token_ids(server, sdk) -> None:
    request = {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}],
               "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    plain = sdk.chat.completions.create(**request).choices[0].logprobs.content
    as_ids = sdk.chat.completions.create(
        **request, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content
    assert [e.logprob for e in as_ids] == pytest.approx([e.logprob for e in plain])
    for plain_entry, id_entry in zip(plain, as_ids):
        for plain_top, id_top in [(plain_entry, id_entry),
                                  *zip(plain_entry.top_logprobs, id_entry.top_logprobs)]:
            assert id_top.token.startswith("token_id:")
            assert id_top.bytes == list(id_top.token.encode())
            token_id = int(id_top.token.removeprefix("token_id:"))
            text = httpx.post(server.url + "/detokenize", json={"tokens": [token_id]}).json()
            assert text["prompt"] == plain_top.token

    completion = sdk.completions.create(model=MODEL_NAME, prompt="Paris is", max_tokens=3,
                                        temperature=0, logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": True})
    logprobs = completion.choices[0].logprobs
    token_ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    text = httpx.post(server.url + "/detokenize", json={"tokens": token_ids}).json()["prompt"]
    assert text == completion.choices[0].text


def test_prompt_logprobs(server, sdk) -> None:
    prompt = "The capital of France is"
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    completion = sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                        temperature=0, extra_body={"prompt_logprobs": 2})
    positions = completion.choices[0].prompt_logprobs
    assert len(positions) == len(prompt_ids) == completion.usage.prompt_tokens
    assert positions[0] is None
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token_id) in position and 1 <= len(position) <= 3
        assert {entry["rank"] for entry in position.values()} >= {1, 2}
        assert all(entry["logprob"] <= 0 and isinstance(entry["decoded_token"], str)
                   for entry in position.values())
    # The same numbers as the legacy echo + logprobs shape.
    echoed = sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                    temperature=0, echo=True, logprobs=0)
    values = echoed.choices[0].logprobs.token_logprobs[:len(prompt_ids)]
    assert values[1:] == pytest.approx(
        [position[str(t)]["logprob"] for t, position in zip(prompt_ids[1:], positions[1:])],
        abs=1e-4)

    messages = [{"role": "user", "content": QUESTION}]
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                       temperature=0, extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == len(chat_ids) == chat.usage.prompt_tokens
    assert chat.prompt_logprobs[0] is None
    assert all(str(t) in position for t, position in zip(chat_ids[1:], chat.prompt_logprobs[1:]))

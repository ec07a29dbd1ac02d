"""Structured outputs through `pagoda serve`: response_format (json_object, json_schema, the
openai client's `parse`), vLLM's guided_json / guided_regex / guided_choice / guided_grammar and
`structured_outputs` on both endpoints, n > 1, streaming; 50+ random JSON schemas whose every
output validates; bad constraints are 400s naming the field the client used, and refused
before the engine sees them; /metrics counts structured requests and compile time."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema
from pydantic import BaseModel, ConfigDict

from tests.entrypoints.server_helpers import MODEL_NAME, SHARED_API_KEY, SHARED_AUTH

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300, headers=SHARED_AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SHARED_API_KEY, max_retries=0)


def chat(http: httpx.Client, **fields) -> dict:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 60,
            **fields}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_texts(http: httpx.Client, **fields) -> list[str]:
    body = chat(http, **fields)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", body
    return [choice["message"]["content"] for choice in body["choices"]]


# ---- random JSON schemas ------------------------------------------------------------------------
# A meta-schema for the subset the grammar engine supports, bounded so every output is short:
# strings have maxLength, integers a range, arrays maxItems, objects at most 3 properties and
# no additional ones, nesting two deep.

NAME = {"enum": ["id", "name", "age", "city", "tags", "ok", "info", "color"]}


def _leaf_meta() -> list[dict]:
    def typed(kind: str, properties: dict | None = None, required: list[str] = ()) -> dict:
        return {"type": "object", "additionalProperties": False,
                "properties": {"type": {"const": kind}, **(properties or {})},
                "required": ["type", *required]}

    return [
        typed("string", {"maxLength": {"type": "integer", "minimum": 1, "maximum": 6}},
              ["maxLength"]),
        typed("integer", {"minimum": {"type": "integer", "minimum": -50, "maximum": 0},
                          "maximum": {"type": "integer", "minimum": 1, "maximum": 99}},
              ["minimum", "maximum"]),
        typed("boolean"),
        typed("null"),
        {"type": "object", "additionalProperties": False, "required": ["enum"],
         "properties": {"enum": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4,
                                 "uniqueItems": True}}},
    ]


def _array_meta(items: dict) -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "items", "maxItems"],
            "properties": {"type": {"const": "array"}, "items": items,
                           "maxItems": {"type": "integer", "minimum": 1, "maximum": 3}}}


def _object_meta(values: dict) -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "properties", "required", "additionalProperties"],
            "properties": {
                "type": {"const": "object"},
                "properties": {"type": "object", "minProperties": 1, "maxProperties": 3,
                               "propertyNames": NAME, "additionalProperties": values},
                "required": {"type": "array", "items": NAME, "maxItems": 3, "uniqueItems": True},
                "additionalProperties": {"const": False},
            }}


LEAF = {"anyOf": _leaf_meta()}
INNER = {"anyOf": [*_leaf_meta(), _array_meta(LEAF)]}
META_SCHEMA = _object_meta({"anyOf": [*_leaf_meta(), _array_meta(LEAF), _object_meta(INNER)]})


def _fix_required(schema: dict) -> dict:
    """`required` names only properties the object has (a meta-schema cannot say so): the
    first k, for the k names generated."""
    if schema.get("type") == "object":
        schema["required"] = list(schema["properties"])[:len(schema["required"])]
        for value in schema["properties"].values():
            _fix_required(value)
    if schema.get("type") == "array":
        _fix_required(schema["items"])
    return schema


def random_schemas(count: int) -> list[dict]:
    """`count` distinct schemas, the same every run."""
    schemas: dict[str, dict] = {}

    @settings(max_examples=count + 10, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(from_schema(META_SCHEMA).map(_fix_required))
    def collect(schema: dict) -> None:
        jsonschema.Draft202012Validator.check_schema(schema)
        if len(schemas) < count:
            schemas.setdefault(json.dumps(schema, sort_keys=True), schema)

    collect()
    return list(schemas.values())


def test_random_schemas_outputs_validate(server):
    """Every output of 50+ random schemas (sent at once, as response_format json_schema)
    parses and validates; nearly all finish by the grammar (stop), not by max_tokens."""
    schemas = random_schemas(52)
    assert len(schemas) >= 50

    async def one(aclient: httpx.AsyncClient, schema: dict) -> dict:
        response = await aclient.post(CHAT, json={
            "model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 120,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "thing", "schema": schema}},
        })
        assert response.status_code == 200, (schema, response.text)
        return response.json()["choices"][0]

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=600,
                                     headers=SHARED_AUTH) as aclient:
            return await asyncio.gather(*(one(aclient, schema) for schema in schemas))

    choices = asyncio.run(main())
    num_stopped = 0
    for schema, choice in zip(schemas, choices):
        if choice["finish_reason"] != "stop":
            continue
        num_stopped += 1
        text = choice["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"schema {json.dumps(schema)}\noutput {text!r}\n{e}") from None
    assert num_stopped >= 0.95 * len(schemas), [c["finish_reason"] for c in choices]


# ---- each way to ask ----------------------------------------------------------------------------


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict

    name: str
    age: int
    likes_cats: bool


def test_openai_client_parse(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, response_format=Person, temperature=0,
        max_tokens=60,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_schema_without_schema(http):
    messages = [{"role": "user",
                 "content": "Describe a person as a JSON object with a name and an age."}]
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "any"}}):
        (text,) = chat_texts(http, messages=messages, response_format=response_format,
                             max_tokens=120)
        value = json.loads(text)
        if response_format["type"] == "json_object":
            assert isinstance(value, dict)


def test_response_format_text_is_unconstrained(http):
    plain = chat(http, max_tokens=8)["choices"][0]["message"]["content"]
    body = chat(http, max_tokens=8, response_format={"type": "text"})
    assert body["choices"][0]["message"]["content"] == plain


def test_guided_regex_choice_grammar(http):
    pattern = r"[A-Z][a-z]{2,8}, age [1-9][0-9]?"
    (text,) = chat_texts(http, guided_regex=pattern)
    assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", "maybe"]
    (text,) = chat_texts(http, guided_choice=choices,
                         messages=[{"role": "user", "content": "Is the sky blue?"}])
    assert text in choices
    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    (text,) = chat_texts(http, guided_grammar=grammar)
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", text), text


def test_guided_json_as_object_and_text(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    for guided_json in (schema, json.dumps(schema)):
        (text,) = chat_texts(http, guided_json=guided_json)
        jsonschema.validate(json.loads(text), schema)


def test_structured_outputs_object_on_completions(http):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    cases = [({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
             ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t) or pytest.fail(t)),
             ({"choice": ["red", "green"]}, lambda t: t in ("red", "green") or pytest.fail(t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t))]
    for structured_outputs, check in cases:
        response = http.post(CMPL, json={
            "model": MODEL_NAME, "prompt": "Here is a person as JSON:", "max_tokens": 60,
            "temperature": 0, "structured_outputs": structured_outputs,
        })
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (structured_outputs, choice)
        check(choice["text"])
    # vLLM's guided_* and response_format work on completions too.
    response = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "Colour:", "max_tokens": 5,
                                     "guided_choice": ["red", "blue"]})
    assert response.json()["choices"][0]["text"] in ("red", "blue")
    response = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "A:", "max_tokens": 60,
                                     "temperature": 0, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(response.json()["choices"][0]["text"]), dict)


def test_n_3_with_schema(http):
    schema = Person.model_json_schema()
    texts = chat_texts(http, n=3, temperature=1.0, seed=7, max_tokens=80,
                       response_format={"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": schema}})
    assert len(texts) == 3
    for text in texts:
        Person.model_validate_json(text)


def test_streamed_schema_deltas_parse(client):
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    pieces, finish_reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reasons.append(choice.finish_reason)
    assert finish_reasons[-1] == "stop"
    Person.model_validate_json("".join(pieces))


# ---- bad constraints ----------------------------------------------------------------------------

BAD = [
    ("schema-bad-type", CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("guided-json-bad-type", CHAT, {"guided_json": {"type": "objectx"}}, "guided_json"),
    ("guided-json-bad-text", CMPL, {"guided_json": "{not json"}, "guided_json"),
    ("regex-unbalanced", CHAT, {"guided_regex": "a(b"}, "guided_regex"),
    ("regex-unbalanced-completions", CMPL, {"guided_regex": "a(b"}, "guided_regex"),
    ("grammar-bad", CHAT, {"guided_grammar": "root ::= ( \"a\""}, "guided_grammar"),
    ("grammar-undefined-rule", CMPL, {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("choice-empty", CHAT, {"guided_choice": []}, "guided_choice"),
    ("choice-empty-string", CMPL, {"guided_choice": [""]}, "guided_choice"),
    ("two-constraints", CHAT, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("format-and-guided-json", CMPL, {"response_format": {"type": "json_object"},
                                      "guided_json": {"type": "object"}}, "guided_json"),
    ("structured-outputs-two", CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("structured-outputs-empty", CMPL, {"structured_outputs": {}}, "structured_outputs"),
    ("structured-outputs-bad-regex", CMPL, {"structured_outputs": {"regex": "a(b"}},
     "structured_outputs"),
    ("structured-outputs-unknown-key", CHAT, {"structured_outputs": {"xml": "a"}},
     "structured_outputs.xml"),
    ("response-format-type", CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    ("json-schema-missing", CHAT, {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("json-schema-not-object", CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
     "response_format.json_schema.schema"),
    ("whitespace-pattern", CHAT, {"guided_json": {"type": "object"},
                                  "guided_whitespace_pattern": " *"},
     "guided_whitespace_pattern"),
]


@pytest.mark.parametrize("path, fields, param", [
    pytest.param(*case[1:], id=case[0]) for case in BAD
])
def test_bad_constraint_is_a_400_naming_the_field(http, path, fields, param):
    assert_refused(http, path, fields, param)


def assert_refused(http: httpx.Client, path: str, fields: dict, param: str) -> None:
    """A 400 with an OpenAI error body whose param is `param`."""
    body = {"model": MODEL_NAME, "max_tokens": 5, **fields}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Hi"})
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert len(error["message"]) > 10
    assert error["message"].startswith(param) or "structured_outputs" not in error["message"]


def test_bad_constraints_never_reach_the_engine(server, http):
    """Refused at the edge: no prompt tokens admitted, no structured request counted."""
    before = (server.metric("prompt_tokens_total"),
              server.metric("structured_output_requests_total"))
    for _, path, fields, param in BAD:
        assert_refused(http, path, fields, param)
    assert (server.metric("prompt_tokens_total"),
            server.metric("structured_output_requests_total")) == before


def test_metrics_count_structured_requests(server, http):
    requests = server.metric("structured_output_requests_total")
    compile_seconds = server.metric("grammar_compile_seconds_total")
    # A schema no other test uses: a cache miss, so compile time grows.
    schema = {"type": "object", "properties": {"metrics_probe": {"type": "boolean"}},
              "required": ["metrics_probe"], "additionalProperties": False}
    chat_texts(http, guided_json=schema)
    chat_texts(http, guided_json=schema, max_tokens=30)  # cached: counted, not compiled
    assert server.metric("structured_output_requests_total") == requests + 2
    assert server.metric("grammar_compile_seconds_total") > compile_seconds

"""The request fields that constrain the output, and their one mapping onto
`SamplingParams.structured_outputs` (both endpoints):

    response_format      OpenAI: {"type": "text" | "json_object" | "json_schema",
                         "json_schema": {"name", "schema", "strict", "description"}}
    guided_json          vLLM: a JSON schema (an object or its JSON text)
    guided_regex         vLLM: a regex the whole output matches
    guided_choice        vLLM: the output is one of these strings
    guided_grammar       vLLM: a grammar (GBNF / EBNF `root ::= ...`, or Lark)
    structured_outputs   vLLM's newer object: exactly one of json, regex, choice, grammar,
                         json_object

At most one of them per request. Every error names the field the client used: shape errors
here, and the grammar engine's verdict on the schema, regex or grammar (raised with param
"structured_outputs" by the InputProcessor), are renamed through `InvalidRequestError.renamed`
with the name `structured_outputs_of` returns.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import PARAM, StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    """The JSON schema; absent means any JSON value."""
    strict: bool | None = None
    """Accepted; the output always follows the schema (constrained decoding)."""


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request object (pagoda.structured_outputs, field for
    field)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(_Strict):
    """Mixed into the requests of both endpoints (protocol.SamplingRequestFields)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    """Refused when set (whitespace in JSON output is compact)."""
    structured_outputs: StructuredOutputsField | None = None


def structured_outputs_of(
    request: StructuredOutputFields,
) -> tuple[StructuredOutputsParams | None, str]:
    """(the request's constraint or None, the field that gave it, which errors about the
    constraint must name). InvalidRequestError for two constraints at once or a bad shape."""
    if request.guided_whitespace_pattern is not None:
        raise InvalidRequestError(
            "guided_whitespace_pattern is not supported (JSON output is compact)",
            "guided_whitespace_pattern", "unsupported_parameter",
        )
    given = [(name, fields) for name, fields in _constraints(request) if fields is not None]
    if len(given) > 1:
        names = [name for name, _ in given]
        raise InvalidRequestError(
            f"give at most one structured-output constraint per request; got "
            f"{' and '.join(names)}", names[-1],
        )
    if not given:
        return None, PARAM
    param, fields = given[0]
    try:
        return StructuredOutputsParams(**fields), param
    except InvalidRequestError as e:
        raise e.renamed(param) from None


def _constraints(request: StructuredOutputFields) -> list[tuple[str, dict[str, Any] | None]]:
    """Each constraint field with the StructuredOutputsParams keywords it means (None when
    it constrains nothing)."""
    response_format = None
    if request.response_format is not None:
        kind = request.response_format.type
        if kind == "json_object":
            response_format = {"json_object": True}
        elif kind == "json_schema":
            json_schema = request.response_format.json_schema
            if json_schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs a json_schema object "
                    '({"name": ..., "schema": {...}})', "response_format.json_schema",
                )
            schema = json_schema.schema_
            response_format = {"json": True if schema is None else schema}
    structured = None
    if request.structured_outputs is not None:
        structured = {
            "json" if name == "json_" else name: value
            for name, value in request.structured_outputs
            if value is not None
        }
    return [
        ("response_format", response_format),
        ("guided_json", None if request.guided_json is None else {"json": request.guided_json}),
        ("guided_regex", None if request.guided_regex is None else {"regex": request.guided_regex}),
        ("guided_choice",
         None if request.guided_choice is None else {"choice": request.guided_choice}),
        ("guided_grammar",
         None if request.guided_grammar is None else {"grammar": request.guided_grammar}),
        ("structured_outputs", structured),
    ]

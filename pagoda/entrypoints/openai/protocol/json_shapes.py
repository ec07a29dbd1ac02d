"""JSON Schemas of what protocol.py checks by hand, so that /openapi.json describes the
requests as the server accepts them:
- fields typed `Any` and checked by a validator (for error messages that say what is
  allowed): annotated with the shapes below;
- value ranges that SamplingParams checks: `bounded(default, minimum=..., ...)` adds them to
  the field's schema only (the check, and its message, stay SamplingParams');
- the role rules of chat messages: CHAT_MESSAGE_RULES.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

_STRING = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_NULL = {"type": "null"}

Stop = Annotated[Any, WithJsonSchema({
    "anyOf": [_STRING, {"type": "array", "items": _STRING}, _NULL],
    "description": "A stop string, or a list of them.",
})]

Prompt = Annotated[Any, WithJsonSchema({
    "anyOf": [
        _STRING,
        {"type": "array", "items": _STRING, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
    "description": "A string, a list of strings, a list of token ids, or a list of "
                   "token-id lists; not empty.",
})]

MessageContent = Annotated[Any, WithJsonSchema({
    "anyOf": [
        _STRING,
        {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STRING},
        }},
        _NULL,
    ],
    "description": "A string, or a list of text parts (joined with newlines).",
})]

ToolChoice = Annotated[Any, WithJsonSchema({
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "additionalProperties": False, "required": ["type", "function"],
         "properties": {
             "type": {"const": "function"},
             "function": {"type": "object", "additionalProperties": False,
                          "required": ["name"], "properties": {"name": _STRING}},
         }},
        _NULL,
    ],
    "description": 'Default "auto" with tools, else "none".',
})]


def bounded(default: Any, **bounds: float) -> Any:
    """A field default whose schema carries JSON Schema bounds (minimum, maximum,
    exclusiveMinimum, ...); validation is not changed."""
    return Field(default, json_schema_extra=bounds)


CHAT_MESSAGE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": _STRING}},
     "else": {"properties": {"tool_call_id": _NULL}}},
    {"if": {"properties": {"role": {"const": "assistant"}}},
     "else": {"properties": {"tool_calls": _NULL}}},
]}
"""A tool message answers a call (tool_call_id, required there and only there); only an
assistant message carries tool_calls."""

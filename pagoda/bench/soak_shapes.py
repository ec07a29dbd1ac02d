"""The soak's client-shaped chat requests: what LangChain's `bind_tools` / `with_structured_output`,
instructor and the Agents SDK send besides plain chat (pagoda/bench/soak.py mixes them in).

    "tool"   tools=[get_weather], tool_choice naming it   -> exactly one call of it, arguments
                                                             a JSON object with a string "city"
    "json"   response_format json_schema {"answer": str}  -> content parses and follows it

They are sampled (seeded) and not streamed; each choice that ends by itself is checked
(`shape_problem`); one cut by max_tokens only has to be a clean answer.
"""

from __future__ import annotations

import json
from typing import Any

GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
                 "required": ["answer"], "additionalProperties": False}
SHAPES = ("tool", "json")


def shape_fields(shape: str) -> dict[str, Any]:
    """The request fields a shape adds to a chat body."""
    if shape == "tool":
        return {"tools": [GET_WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}


def shape_problem(shape: str, choice: dict) -> str | None:
    """What is wrong with a whole chat choice of a shaped request (None: nothing)."""
    message, reason = choice.get("message") or {}, choice.get("finish_reason")
    if shape == "tool":
        calls = message.get("tool_calls") or []
        if reason == "length":
            return None if message.get("content") is None else "a cut call leaked content"
        if reason != "tool_calls" or len(calls) != 1:
            return f"finish_reason {reason!r} with {len(calls)} call(s), not one call"
        function = calls[0].get("function") or {}
        try:
            arguments = json.loads(function.get("arguments", ""))
        except ValueError:
            arguments = None
        if function.get("name") != "get_weather" or not isinstance(arguments, dict) \
                or not isinstance(arguments.get("city"), str):
            return f"a call that does not follow the schema: {function!r:.120}"
        return None
    if reason != "stop":
        return None
    try:
        value = json.loads(message.get("content") or "")
    except ValueError:
        value = None
    if not isinstance(value, dict) or set(value) != {"answer"} \
            or not isinstance(value["answer"], str):
        return f"content that does not follow the schema: {message.get('content')!r:.120}"
    return None

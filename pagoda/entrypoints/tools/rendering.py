"""A conversation with tools -> prompt text, through the model's chat template.

Messages are OpenAI's, as dicts: {"role", "content"} plus, on assistant messages,
"tool_calls" ([{"id", "type": "function", "function": {"name", "arguments": JSON text}}])
and, on "tool" messages, "tool_call_id". `tools` are OpenAI's [{"type": "function",
"function": {"name", "description", "parameters"}}].

A template that knows tools (it reads a `tools` variable) gets them as they are, as vLLM
passes them: `apply_chat_template(messages, tools=tools)`, with each call's arguments parsed
to an object (what Hugging Face templates expect: Llama 3.1's `| tojson`, Qwen3-Coder's
`arguments|items`, Llama 4's pythonic `%r` of each value), and "tool" messages as they are
(Llama 3.1 templates render them as the ipython role themselves). Mistral templates (they
write `[TOOL_CALLS]`) accept only 9-character alphanumeric call ids: each OpenAI id
(`call_...`) is mapped to one, the same every time (`short_call_id`), so that a call and its
result still match. For any other template (the bundled
SmolLM2's among them) the tools are written into the conversation in the Hermes format that
Qwen2.5 and Hermes 2 Pro are trained on, using only the roles every template accepts:

- a system block listing the tools, appended to the first system message (or a new one):

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": "get_weather", ...}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- an assistant message's calls, after its text, one block each:
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`;
- tool results as a user message, consecutive results together, one block each:
  `<tool_response>\\n<the tool message's content>\\n</tool_response>`.

A conversation without tools or tool messages renders exactly as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from typing import Any

import jinja2
import jinja2.meta

from pagoda.entrypoints.chat_template import apply_chat_template, check_messages

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_chat(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation that may carry tools, tool calls and tool results
    (InvalidRequestError about `messages` for what the template cannot render);
    `template_kwargs`: chat_template.template_kwargs_of's, passed on to the template."""
    check_messages(messages)
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool"
                                    for m in messages)
    if not uses_tools:
        return apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt,
                                   template_kwargs=template_kwargs)
    template = _template_text(chat_template or tokenizer.chat_template)
    if template_knows_tools(template):
        native = [_with_parsed_arguments(m) for m in messages]
        if MISTRAL_MARKER in template:
            native = [_with_short_call_ids(m) for m in native]
        return apply_chat_template(tokenizer, native, chat_template, add_generation_prompt,
                                   tools=tools or None, template_kwargs=template_kwargs)
    return apply_chat_template(tokenizer, fallback_messages(messages, tools), chat_template,
                               add_generation_prompt, template_kwargs=template_kwargs)


def template_knows_tools(template: str | dict | None) -> bool:
    """Whether a chat template reads the `tools` variable (then it renders tools itself)."""
    template = _template_text(template)
    return template is not None and _reads_tools(template)


def _template_text(template: str | dict | None) -> str | None:
    """The template used with tools (of named templates, Hugging Face picks "tool_use")."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    try:
        variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # extensions we do not load: look for the name instead
        return re.search(r"\btools\b", template) is not None
    return "tools" in variables


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
) -> list[dict[str, str]]:
    """The conversation in plain system/user/assistant messages (the format above)."""
    result: list[dict[str, str]] = []
    after_tool = False
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if after_tool:  # results of one turn's calls share a user message
                result[-1]["content"] += "\n" + block
            else:
                result.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        entry = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if message.get("tool_calls"):
            blocks = [call_block(call["function"]) for call in message["tool_calls"]]
            entry["content"] = "\n".join(([entry["content"]] if entry["content"] else [])
                                         + blocks)
        result.append(entry)
    if tools:
        block = TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) \
            + TOOLS_FOOTER
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": result[0]["content"] + "\n\n" + block}
        else:
            result.insert(0, {"role": "system", "content": block})
    return result


def call_block(function: dict[str, Any]) -> str:
    """A call written as the model writes it: `<tool_call>\\n{json}\\n</tool_call>`."""
    call = {"name": function["name"], "arguments": _arguments(function["arguments"])}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _arguments(arguments: Any) -> Any:
    """Arguments as an object when they are JSON text of one (they are checked before)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"],
                                   "arguments": _arguments(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
ALPHANUMERIC = string.ascii_letters + string.digits


def short_call_id(call_id: str) -> str:
    """A 9-character alphanumeric id standing for `call_id` (itself if it is one already),
    the same for the same id (62**9 ids: a clash between two calls of one conversation is
    about as likely as a sha256 collision of its first 54 bits)."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        number, digit = divmod(number, len(ALPHANUMERIC))
        chars.append(ALPHANUMERIC[digit])
    return "".join(chars)


def _with_short_call_ids(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_call_id") is not None:
        return {**message, "tool_call_id": short_call_id(message["tool_call_id"])}
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [{**call, "id": short_call_id(call["id"])}
                                      for call in message["tool_calls"]]}

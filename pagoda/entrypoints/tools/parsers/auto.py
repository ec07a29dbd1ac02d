"""`--tool-call-parser auto`: the parser a chat template's own conventions call for, picked
once when the server starts (per model). The template is the one prompts are rendered with
(--chat-template, else the model's; of named templates the "tool_use" one, else
"default"). The first rule that matches wins:

    the template has                                    parser
    <|channel|>  (OpenAI's harmony, gpt-oss)            openai
    <function=  (Qwen3-Coder's XML calls)               qwen3_coder
    [TOOL_CALLS]                                        mistral
    [func_name1(  or  <|python_start|>  (pythonic)      pythonic
    <|python_tag|>  or the ipython role (Llama 3.x)     llama3_json
    <tool_call>  (Hermes, Qwen2.5)                      hermes
    anything else, or no template                       hermes (the fallback prompt's format)

Pythonic comes before llama3_json because Llama 3.2's pythonic templates keep the ipython
role; qwen3_coder before hermes because its blocks are `<tool_call>` too.
"""

from __future__ import annotations

import logging
import re

from pagoda.entrypoints.tools.parsers.registry import AUTO, TOOL_PARSER_CHOICES, TOOL_PARSERS

logger = logging.getLogger(__name__)

RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"<\|channel\|>"), "openai"),
    (re.compile(r"<function="), "qwen3_coder"),
    (re.compile(r"\[TOOL_CALLS\]"), "mistral"),
    (re.compile(r"\[func_name\d*\(|<\|python_start\|>"), "pythonic"),
    (re.compile(r"<\|python_tag\|>|\bipython\b"), "llama3_json"),
    (re.compile(r"<tool_call>"), "hermes"),
)
DEFAULT = "hermes"


def resolve_tool_call_parser(name: str, chat_template: str | dict | None) -> str:
    """The parser `name` stands for: itself, or for "auto" the one `chat_template` calls for
    (the module doc's rules). ValueError for a name that is neither a parser nor "auto"."""
    if name != AUTO:
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                             f"{', '.join(TOOL_PARSER_CHOICES)}")
        return name
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    chosen = DEFAULT
    if isinstance(chat_template, str):
        chosen = next((parser for pattern, parser in RULES if pattern.search(chat_template)),
                      DEFAULT)
    logger.info("--tool-call-parser auto: %s, from the chat template", chosen)
    return chosen

"""`--reasoning-parser auto`: the parser a chat template's model needs, decided once when the
model is served.

The rule, first match wins:

0. The template writes harmony's `<|channel|>` -> `openai_gptoss` (gpt-oss).
1. The template's generation prompt (what `add_generation_prompt` adds after a one-message
   conversation, rendered with the template's defaults) contains `<think>`: the model starts
   its answer inside the reasoning -> `deepseek_r1` (DeepSeek-R1 distills, QwQ, Qwen3
   "Thinking-2507").
2. The template mentions `<think>` or `enable_thinking` anywhere -> `qwen3` (the model
   opens its own `<think>` block, or the template can switch thinking off).
3. Otherwise no reasoning parser: the output is all content.

Rendering uses a sandboxed Jinja environment like Hugging Face's; a template that cannot be
rendered there (a Jinja extension, a check that needs other messages) falls back to reading
the text: `<think>` inside the first literal printed under `if add_generation_prompt`.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagoda.entrypoints.harmony import CHANNEL
from pagoda.entrypoints.reasoning.harmony import HarmonyReasoningParser
from pagoda.entrypoints.reasoning.parsers import (
    THINK_START,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from pagoda.entrypoints.reasoning.registry import REASONING_PARSERS

logger = logging.getLogger(__name__)

AUTO = "auto"
REASONING_PARSER_CHOICES = (*sorted(REASONING_PARSERS), AUTO)
"""What --reasoning-parser takes."""

_PROBE = [{"role": "user", "content": "Hi"}]
_GENERATION_LITERAL_THINKS = re.compile(
    r"if\s+add_generation_prompt\s*-?%\}\s*\{\{-?\s*(['\"])(?:(?!\1).)*<think>", re.DOTALL)
"""`{% if add_generation_prompt %}{{ '...<think>...' }}`: the first literal it prints opens a
think block."""


def resolve_reasoning_parser(name: str | None, chat_template: str | dict | None) -> str | None:
    """The parser to run: `name` itself unless it is "auto", then the rule above for
    `chat_template` (a named-template dict: its "default"); None: no reasoning parser."""
    if name != AUTO:
        return name
    template = chat_template.get("default") if isinstance(chat_template, dict) else chat_template
    if not isinstance(template, str):
        return None
    if CHANNEL in template:  # harmony's channels (gpt-oss)
        return HarmonyReasoningParser.name
    generation_prompt = render_generation_prompt(template)
    if generation_prompt is not None:
        opens_thinking = THINK_START in generation_prompt
    else:
        opens_thinking = _GENERATION_LITERAL_THINKS.search(template) is not None
    if opens_thinking:
        return DeepSeekR1ReasoningParser.name
    if THINK_START in template or "enable_thinking" in template:
        return Qwen3ReasoningParser.name
    return None


def render_generation_prompt(template: str) -> str | None:
    """What the template adds for `add_generation_prompt` after one user message; None if
    it cannot be rendered here."""
    try:
        compiled = _environment().from_string(template)
        rendered = [compiled.render(messages=_PROBE, add_generation_prompt=add,
                                    bos_token="", eos_token="", tools=None)
                    for add in (False, True)]
    except Exception as e:  # noqa: BLE001 -- templates are code: any failure means "unknown"
        logger.debug("chat template not rendered for --reasoning-parser auto: %s", e)
        return None
    without, with_prompt = rendered
    if not with_prompt.startswith(without):
        return None
    return with_prompt[len(without):]


def _environment() -> jinja2.Environment:
    """Hugging Face's chat-template environment, minus its `{% generation %}` tag."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(
        value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env

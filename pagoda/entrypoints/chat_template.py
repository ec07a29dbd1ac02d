"""Chat templates: a conversation -> the model's prompt text -> its token ids.

Shared by the offline `LLM.chat` and the server's /v1/chat/completions and /tokenize, so that
the same conversation becomes the same tokens everywhere (a greedy chat answer from the
server equals the offline one).
"""

from __future__ import annotations

from typing import Any

from pagoda.errors import InvalidRequestError

Message = dict[str, Any]
"""An OpenAI message: role and content, and tool_calls / tool_call_id where they apply."""


def check_messages(messages: list[Message]) -> None:
    """InvalidRequestError about `messages` unless it is a non-empty list of dicts that
    each have a role and a content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role', 'content'} dicts", "messages"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(
                f"each message needs 'role' and 'content', got {m!r}", "messages"
            )


def apply_chat_template(
    tokenizer, messages: list[Message], chat_template: str | None = None,
    add_generation_prompt: bool = True, tools: list[dict] | None = None,
) -> str:
    """Render a conversation to the prompt text. A malformed conversation, or a model
    without a template (and none given), raises InvalidRequestError about `messages`.
    `tools` go to templates that render them (see pagoda/entrypoints/tools/rendering.py,
    which also writes them for templates that do not)."""
    check_messages(messages)
    if chat_template is None and tokenizer.chat_template is None:
        raise InvalidRequestError(
            "this model has no chat template; pass one with --chat-template", "messages"
        )
    extra = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **extra,
    )


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt. The template already placed every special token
    (BOS included, where the model has one), so the tokenizer must not add its own."""
    return tokenizer.encode(text, add_special_tokens=False)

"""Chat templates: a conversation -> the model's prompt text -> its token ids.

Shared by the offline `LLM.chat` and the server's /v1/chat/completions and /tokenize, so that
the same conversation becomes the same tokens everywhere (a greedy chat answer from the
server equals the offline one).

Requests may add keywords for the template (`template_kwargs_of`): vLLM's
`chat_template_kwargs` (e.g. Qwen3's `enable_thinking: false`), OpenAI's `reasoning_effort`
(a template variable of that name), and `continue_final_message` (Hugging Face's: the last
message, usually the assistant's, is left open for the model to continue).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.errors import InvalidRequestError

Message = dict[str, Any]
"""An OpenAI message: role and content, and tool_calls / tool_call_id where they apply."""

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Names chat_template_kwargs may not use: the renderer's own arguments (each has its own
request field, or none)."""


def template_kwargs_of(
    chat_template_kwargs: Mapping[str, Any] | None, *, add_generation_prompt: bool,
    continue_final_message: bool = False, reasoning_effort: str | None = None,
) -> dict[str, Any]:
    """The keywords a request adds to `apply_chat_template`: `reasoning_effort` (when set),
    then `chat_template_kwargs` (which win), then `continue_final_message` (when set).
    InvalidRequestError naming the field at fault."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError.about(
            "continue_final_message", "cannot be combined with add_generation_prompt (both "
            "true): set add_generation_prompt to false to continue the last message")
    kwargs: dict[str, Any] = {}
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    for name, value in (chat_template_kwargs or {}).items():
        if name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError.about(
                f"chat_template_kwargs.{name}", "is an argument of the template renderer, "
                "not a template variable; use the request field of that name, if any")
        kwargs[name] = value
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


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
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render a conversation to the prompt text. A malformed conversation, or a model
    without a template (and none given), raises InvalidRequestError about `messages`.
    `tools` go to templates that render them (see pagoda/entrypoints/tools/rendering.py,
    which also writes them for templates that do not); `template_kwargs` are
    `template_kwargs_of`'s."""
    check_messages(messages)
    if chat_template is None and tokenizer.chat_template is None:
        raise InvalidRequestError(
            "this model has no chat template; pass one with --chat-template", "messages"
        )
    extra = dict(template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **extra,
    )


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt. The template already placed every special token
    (BOS included, where the model has one), so the tokenizer must not add its own."""
    return tokenizer.encode(text, add_special_tokens=False)

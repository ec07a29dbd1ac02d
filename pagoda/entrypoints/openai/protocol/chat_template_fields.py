"""The request fields that reach the chat template besides the messages (mixed into
protocol.py's chat and /tokenize requests; parsed strictly like the rest):

    chat_template_kwargs    vLLM's: a JSON object of template variables, e.g.
                            {"enable_thinking": false} for Qwen3
    continue_final_message  vLLM's: the last message is continued, not closed (needs
                            add_generation_prompt false; else a 400 naming both)
    reasoning_effort        OpenAI's (chat only): given to the template as the variable
                            `reasoning_effort` (templates that know it change the prompt;
                            others ignore it)

What they mean is pagoda/entrypoints/chat_template.py's `template_kwargs_of`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagoda.entrypoints.chat_template import template_kwargs_of

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""The values the OpenAI SDK sends (openai.types.shared.ReasoningEffort)."""


class ChatTemplateFields(BaseModel):
    """On chat requests and /tokenize (which renders messages as chat does). The request
    also has `add_generation_prompt`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template, by name (vLLM's)."""
    continue_final_message: bool | None = False
    """Continue the last message instead of closing it (vLLM's)."""

    def template_kwargs(self) -> dict[str, Any]:
        """The keywords for apply_chat_template; InvalidRequestError naming the field."""
        return template_kwargs_of(
            self.chat_template_kwargs,
            add_generation_prompt=getattr(self, "add_generation_prompt", True) is not False,
            continue_final_message=bool(self.continue_final_message),
            reasoning_effort=getattr(self, "reasoning_effort", None),
        )


class ChatReasoningFields(ChatTemplateFields):
    """On chat requests."""

    reasoning_effort: ReasoningEffort | None = None
    """OpenAI's; passed to the chat template as `reasoning_effort`."""

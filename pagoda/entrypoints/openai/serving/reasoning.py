"""Chat's reasoning, between the protocol and pagoda/entrypoints/reasoning/ (the server runs
one parser for all requests: --reasoning-parser, "auto" resolved from the chat template
when the model is served):

    output text ── reasoning parser ──┬─ reasoning ──────────> message.reasoning_content /
       (whole or streamed deltas)     │                         delta.reasoning_content
                                      └─ the rest: content ──> tool-call parser when the
                                                               request offers tools
                                                               (serving/tools.py), else
                                                               message.content / delta.content

    request's constraint (response_format, guided_*, tool_choice "required" / named)
       ── after_reasoning = the parser's span ──> the grammar leaves the thinking free
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pagoda.entrypoints.openai.serving.job import SamplingFields
from pagoda.entrypoints.openai.serving.tools import ChatChoiceState
from pagoda.entrypoints.reasoning.auto import resolve_reasoning_parser
from pagoda.entrypoints.reasoning.parsers import (
    ReasoningParser,
    ReasoningSplit,
    split_reasoning,
)
from pagoda.entrypoints.reasoning.registry import REASONING_PARSERS
from pagoda.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class ReasoningChoiceState(ChatChoiceState):
    """A streamed chat choice: its tool-call parser (ChatChoiceState) and its reasoning
    parser, both decided on the choice's first delta (`tools_planned`)."""

    reasoning: ReasoningParser | None = None


def chat_reasoning_parser(name: str | None, chat_template: str | dict | None,
                          model_name: str) -> str | None:
    """The parser a served model's chat runs ("auto": from its template); logged once."""
    resolved = resolve_reasoning_parser(name, chat_template)
    if name is not None:
        logger.info("model %r: reasoning parser %s%s", model_name, resolved or "none",
                    " (auto, from the chat template)" if resolved != name else "")
    return resolved


def new_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if name is None else REASONING_PARSERS[name]()


def split_output(name: str | None, text: str) -> ReasoningSplit:
    """A whole output's reasoning and content (no parser: all content, as written)."""
    if name is None:
        return ReasoningSplit(None, text)
    return split_reasoning(REASONING_PARSERS[name](), text)


def constrain_after_reasoning(name: str | None, fields: SamplingFields) -> None:
    """With a reasoning parser, the request's constraint (if any) starts after the thinking;
    a 400 where the parser's format leaves no place for one (harmony's)."""
    if name is None or fields.structured_outputs is None:
        return
    span = REASONING_PARSERS[name].span()
    if span is None:
        field = fields.name_of("structured_outputs")
        raise InvalidRequestError.about(
            field, f"{field} cannot be combined with the {name} reasoning format (its "
                   f"markers are special tokens a constraint cannot write)")
    fields.structured_outputs = dataclasses.replace(fields.structured_outputs,
                                                    after_reasoning=span)


def keep_reasoning_special_tokens(name: str | None, request) -> None:
    """A reasoning format whose markers are special tokens (harmony's) is decoded with
    them, unless the request says otherwise (skip_special_tokens)."""
    if (name is not None and REASONING_PARSERS[name].keeps_special_tokens
            and "skip_special_tokens" not in request.model_fields_set):
        request.skip_special_tokens = False

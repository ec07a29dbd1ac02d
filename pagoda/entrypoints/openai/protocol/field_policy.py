"""The field policy: what Pagoda does with each field of OpenAI's published request schemas
for POST /v1/chat/completions and POST /v1/completions.

Every field of those schemas is accepted by the parser (protocol.py declares each one), so a
client library that sets one of them globally never fails on it. Each field is of one kind:

    honoured   Pagoda does what the field asks.
    ignored    The field has no meaning here (billing, storage, OpenAI-side caching, routing,
               safety identifiers, hints for OpenAI's own models): accepted, changes nothing,
               and named in ONE warning log line per request that sets it, e.g.
               "POST /v1/chat/completions: ignored fields without meaning here:
               prompt_cache_key, verbosity".
    refused    Pagoda cannot do what the field asks, and doing without it would change the
               answer (audio output, insertion, moderation, the legacy `functions`): a 400
               `unsupported_parameter` naming it. A value that asks nothing beyond what
               Pagoda does passes (null, `modalities: ["text"]`, `function_call: "auto"`,
               `best_of` equal to `n`); the checks are the requests' `unsupported_fields`.

A field in no schema (OpenAI's or vLLM's extras, protocol.py) is a 400 naming it
(`unknown_parameter`), as OpenAI answers one. tests/entrypoints/test_field_policy.py checks
these tables against the installed `openai` SDK's request TypedDicts, so they cannot drift.

Nested shapes follow the same rule where Pagoda owns them: `stream_options.include_obfuscation`
is ignored (Pagoda's chunks carry no obfuscation padding) and named in the warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldPolicy:
    """One endpoint's OpenAI request fields by kind (top-level names; `ignored` may also hold
    dotted paths into nested objects)."""

    endpoint: str
    honoured: frozenset[str]
    ignored: frozenset[str]
    refused: frozenset[str]

    @property
    def openai_fields(self) -> frozenset[str]:
        """Every top-level field of OpenAI's schema for the endpoint."""
        return self.honoured | self.refused | {n for n in self.ignored if "." not in n}

    def ignored_in(self, request: Any) -> list[str]:
        """The ignored fields the request set to a value (null counts as not set), sorted."""
        return sorted(name for name in self.ignored if _value_at(request, name) is not None)

    def warn_ignored(self, request: Any) -> list[str]:
        """Log the one warning line naming the request's ignored fields (none: no line)."""
        names = self.ignored_in(request)
        if names:
            logger.warning("POST %s: ignored fields without meaning here: %s",
                           self.endpoint, ", ".join(names))
        return names


def _value_at(obj: Any, path: str) -> Any:
    for name in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


# Fields both endpoints share, and what each kind means for them.
_SHARED_HONOURED = frozenset({
    "model", "n", "temperature", "top_p", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "stream", "stream_options",
})
_SHARED_IGNORED = frozenset({
    "user",                                  # an end-user id for OpenAI's abuse monitoring
    "stream_options.include_obfuscation",    # padding against side channels; none is sent
})

CHAT_FIELDS = FieldPolicy(
    endpoint="/v1/chat/completions",
    honoured=_SHARED_HONOURED | {
        "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
        "tool_choice", "parallel_tool_calls",
        "reasoning_effort",        # handed to the chat template (reasoning models read it)
    },
    ignored=_SHARED_IGNORED | {
        "store",                   # OpenAI keeps the completion for its dashboard / evals
        "metadata",                # tags for stored completions
        "service_tier",            # OpenAI's billing and latency tiers
        "prompt_cache_key",        # OpenAI's prompt-cache routing (Pagoda's prefix cache
        "prompt_cache_retention",  #   is automatic)
        "prompt_cache_options",
        "safety_identifier",       # an end-user id for OpenAI's abuse monitoring
        "verbosity",               # a hint OpenAI's GPT-5 models follow
        "prediction",              # predicted output: only speeds OpenAI up; same answer
        "web_search_options",      # OpenAI's search models; Pagoda searches nothing
    },
    refused=frozenset({
        "audio",          # audio output
        "modalities",     # only ["text"] passes
        "functions",      # the legacy form of tools: send `tools`
        "function_call",  # only "none" / "auto" pass: send `tool_choice`
        "moderation",     # Pagoda runs no moderation model: blocking cannot be promised
    }),
)

COMPLETION_FIELDS = FieldPolicy(
    endpoint="/v1/completions",
    honoured=_SHARED_HONOURED | {"prompt", "echo"},
    ignored=_SHARED_IGNORED,
    refused=frozenset({
        "suffix",   # insertion needs a fill-in-the-middle model
        "best_of",  # only best_of == n passes (every sampled choice is returned)
    }),
)

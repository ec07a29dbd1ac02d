"""--speculative-config: speculative decoding's settings (pagoda/executor/spec_decode/) as one
JSON object with vLLM's keys, parsed and checked into a SpeculativeConfig (EngineConfig holds
the text as its option and the parsed form beside it)."""

from __future__ import annotations

import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                    "prompt_lookup_min", "adaptive")
DEFAULT_PROMPT_LOOKUP = 5
"""n-gram length when neither prompt_lookup_max nor prompt_lookup_min is given (vLLM's)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (pagoda/executor/spec_decode/): what --speculative-config's JSON
    object holds, with vLLM's keys. Built by `parse_speculative_config`."""

    method: str
    """ngram (prompt lookup, no extra model) or draft_model (a smaller model)."""
    num_speculative_tokens: int
    """Tokens proposed per request per step (k)."""
    model: str | None = None
    """The draft model (GGUF file or HF folder), same tokenizer as the target; draft_model only."""
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    """Longest n-gram matched (ngram only)."""
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    """Shortest n-gram matched (ngram only)."""
    adaptive: bool = True
    """Stop proposing for a request whose proposals are mostly rejected (spec_decode/adaptive.py)."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if type(self.num_speculative_tokens) is not int or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config num_speculative_tokens must be an int >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config method "draft_model" needs "model": the '
                             "draft model's GGUF file or HF folder")
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config "model" is for method "draft_model"; '
                             '"ngram" uses no extra model')
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if type(self.adaptive) is not bool:
            raise ValueError(f"speculative_config adaptive must be true or false, "
                             f"got {self.adaptive!r}")


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON text (or LLM()'s dict) -> SpeculativeConfig; None stays
    None. ValueError naming the problem for bad JSON, unknown keys or bad values."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")  # noqa: TRY004
    unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; the keys are "
                         f"{', '.join(SPECULATIVE_KEYS)}")
    fields = dict(value)
    if "method" not in fields:
        fields["method"] = "draft_model" if fields.get("model") else "ngram"
    if "num_speculative_tokens" not in fields:
        raise ValueError("speculative_config needs num_speculative_tokens")
    lookup_max, lookup_min = fields.get("prompt_lookup_max"), fields.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
    fields["prompt_lookup_max"] = lookup_min if lookup_max is None else lookup_max
    fields["prompt_lookup_min"] = lookup_max if lookup_min is None else lookup_min
    return SpeculativeConfig(**fields)

"""Sampling parameters of one request, validated on construction.

Field names and defaults follow vLLM's ``SamplingParams`` so that OpenAI-protocol requests
map onto them one to one. The object is framework-free (no torch): the service layer builds
it, the scheduling layer reads ``max_tokens``/``min_tokens``/``stop*``, and the execution
layer turns a batch of them into tensors (``pagoda.executor.sampling_metadata.SamplingMetadata``).

Pipeline of ``__post_init__``:
    1. normalise: ``top_k=-1`` -> 0, ``stop`` -> list[str], ``stop_token_ids`` -> list[int]
    2. validate every field; a bad value raises ``InvalidRequestError`` (a ValueError) whose
       ``param`` is the field's name and whose message says the allowed range

Checks against the model (vocabulary, context length) come later, in
``pagoda.engine.core.input_processor``: these params know nothing of the model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import NoReturn

from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax); dividing by them is unstable.
SAMPLING_EPS = 1e-5
# Most top alternatives a request may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
# Most completions one request may ask for (OpenAI's bound on ``n``): each is a sequence.
MAX_N = 128
# OpenAI's range for ``logit_bias`` values.
MAX_LOGIT_BIAS = 100.0
# ``repetition_penalty`` lies in [1 / MAX, MAX]: beyond, dividing or multiplying float32
# logits by it can leave a row with no finite probability (found by fuzzing: 5e-324).
MAX_REPETITION_PENALTY = 1e6


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(param: str, detail: str) -> NoReturn:
    """Refuse the value of field `param`: the message reads "<param> <detail>"."""
    raise InvalidRequestError.about(param, detail)


@dataclass
class SamplingParams:
    """How to sample the completion of one request (vLLM field names and defaults)."""

    n: int = 1
    """Number of completions to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of tokens in the output; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output; > 0."""
    temperature: float = 1.0
    """Softmax temperature; 0 (anything below 1e-5) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much mass; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1, normalised to 0) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability; in [0, 1]."""
    seed: int | None = None
    """Seed of the request's own random generator: same seed, same output, whatever the batch."""
    stop: str | list[str] | None = None
    """Strings that end the completion (normalised to a list)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the completion, in addition to EOS (normalised to a list)."""
    ignore_eos: bool = False
    """Keep generating after EOS; EOS is then no stop token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """Stop tokens (EOS and stop_token_ids) are banned until this many tokens are generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0: just the token)."""
    prompt_logprobs: int | None = None
    """Like ``logprobs``, for every prompt token."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling; values in [-100, 100]."""
    structured_outputs: StructuredOutputsParams | None = None
    """A JSON schema, regex, choice or grammar the output must match (constrained decoding:
    only tokens the grammar allows are sampled)."""

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            _fail("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            _fail("stop_token_ids", f"must be a list of ints, got {self.stop_token_ids!r}")
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", f"must be an int in [1, {MAX_N}], got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not _is_number(rep) or not (1 / MAX_REPETITION_PENALTY <= rep
                                       <= MAX_REPETITION_PENALTY):
            _fail("repetition_penalty", f"must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                                        f"{MAX_REPETITION_PENALTY:g}], got {rep!r}")
        temp = self.temperature
        if not _is_number(temp) or not temp >= 0.0:
            _fail("temperature", f"must be >= 0, got {temp!r}")
        if math.isinf(temp):
            _fail("temperature", f"must be finite, got {temp!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", f"must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", f"must be an int or None, got {self.seed!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                _fail("stop", f"must contain only non-empty strings, got {stop!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                _fail("stop_token_ids", f"must contain only ints >= 0, got {token_id!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, f"must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", f"must be a dict of token id -> float, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    _fail("logit_bias", f"keys must be token ids (ints >= 0), got {token_id!r}")
                if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    _fail("logit_bias", f"values must be in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            _fail("structured_outputs", "must be a StructuredOutputsParams, got "
                  f"{type(self.structured_outputs).__name__}")

    def clone(self) -> SamplingParams:
        """A deep copy (the engine gives each of the ``n`` children its own)."""
        return copy.deepcopy(self)

"""The one validation step of a request: prompt -> token ids checked against the model's
limits, with the SamplingParams (already valid on their own) checked against the vocabulary.

Every edge runs it once, before the request is queued: the offline `LLM` and
`LLMEngine.add_request` on the caller's thread, the async engine on the event loop (so a bad
request is answered without a trip to the engine thread). What comes out, an `EngineRequest`,
is plain data the engine trusts: the layers below keep assertions only. Errors are
`InvalidRequestError`s naming the field; endpoints whose fields are named differently (chat's
`messages`, `max_completion_tokens`) pass their names in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import ModelPooling, PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A validated request, as the engine takes it."""

    request_id: str
    prompt: str | None
    """The prompt text when the request gave text (kept for the output), else None."""
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Output tokens allowed: params.max_tokens capped by the room the context leaves."""
    arrival_time: float
    priority: int = 0
    grammar: str | None = None
    """The compiled (validated) grammar of params.structured_outputs, if any."""
    pooling: PoolingParams | None = None
    """Set for a pooling (embedding) request, resolved against the model: prefill only, it
    ends with its vector (RequestOutput.embedding) and samples nothing (`params` are then
    neutral and unused, max_tokens 0)."""
    lora_request: LoRARequest | None = None
    """The adapter to run with (None: the base model)."""


class InputProcessor:
    def __init__(
        self, tokenizer, vocab_size: int, max_model_len: int, grammar_compiler=None,
        model_pooling: ModelPooling | None = None,
    ) -> None:
        """`grammar_compiler`: a pagoda.engine.core.grammar.GrammarCompiler, or None when the
        engine takes no structured-output requests. `model_pooling`: how the model pools
        embeddings (None: the engine takes no pooling requests)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammar_compiler = grammar_compiler
        self.model_pooling = model_pooling

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        reject_over_length: bool = False,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """Tokenize (unless `prompt_token_ids` is given) and check. `reject_over_length`:
        refuse a max_tokens that does not fit beside the prompt (the OpenAI server's rule)
        instead of capping it (the offline API's)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        prompt_token_ids = self._prompt_token_ids(prompt, prompt_token_ids, prompt_param)
        max_tokens = self._check_length(
            len(prompt_token_ids), params.max_tokens, reject_over_length, prompt_param,
            max_tokens_param,
        )
        for name, token_ids in (("logit_bias", params.logit_bias or {}),
                                ("stop_token_ids", params.stop_token_ids)):
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise InvalidRequestError(
                        f"{name}: token id {token_id} is out of the vocabulary (size "
                        f"{self.vocab_size})", name,
                    )
        grammar = None
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise InvalidRequestError("structured outputs are not available on this engine",
                                          "structured_outputs")
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        return EngineRequest(
            grammar=grammar,
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            lora_request=_checked_lora(lora_request),
        )

    def process_pooling(
        self,
        request_id: str,
        prompt: str | list[int],
        params: PoolingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_param: str = "input",
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """A pooling (embedding) request: tokenize (unless `prompt_token_ids` is given),
        check, and resolve `params` against the model (`dimensions` checked there). The
        whole context is the prompt's: no room for output is needed."""
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"expected PoolingParams, got {type(params).__name__}")
        if self.model_pooling is None:
            raise InvalidRequestError("embeddings are not available on this engine",
                                      prompt_param, "unsupported_parameter")
        prompt_token_ids = self._prompt_token_ids(prompt, prompt_token_ids, prompt_param)
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"{prompt_param} is {len(prompt_token_ids)} tokens, but this model's maximum "
                f"context length is {self.max_model_len} tokens. Please reduce the length of "
                f"the {prompt_param}.", prompt_param, "context_length_exceeded",
            )
        return EngineRequest(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_token_ids,
            params=SamplingParams(max_tokens=None),
            max_tokens=0,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            pooling=params.resolved(self.model_pooling),
            lora_request=_checked_lora(lora_request),
        )

    def _prompt_token_ids(self, prompt, prompt_token_ids, prompt_param: str) -> list[int]:
        """The prompt's token ids (`prompt_token_ids` if given, else `prompt` tokenized or
        taken as ids), checked against the vocabulary."""
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids = prompt
            else:
                raise InvalidRequestError(
                    f"{prompt_param} must be a string or a list of token ids, got "
                    f"{type(prompt).__name__}", prompt_param,
                )
        prompt_token_ids = list(prompt_token_ids)
        self._check_token_ids(prompt_token_ids, prompt_param)
        return prompt_token_ids

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise InvalidRequestError(f"{param} is empty; give at least one token", param)
        for token_id in token_ids:
            if not (isinstance(token_id, int) and 0 <= token_id < self.vocab_size):
                raise InvalidRequestError(
                    f"{param} token id {token_id!r} is out of range; ids must be in "
                    f"[0, {self.vocab_size})", param,
                )

    def _check_length(
        self, num_prompt_tokens: int, max_tokens: int | None, reject_over_length: bool,
        prompt_param: str, max_tokens_param: str,
    ) -> int:
        """The output tokens allowed; raises if the prompt leaves no room (or, when
        `reject_over_length`, if prompt + max_tokens exceeds the context)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"{prompt_param} is {num_prompt_tokens} tokens, but this model's maximum "
                f"context length is {limit} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_param}.",
                prompt_param, "context_length_exceeded",
            )
        room = limit - num_prompt_tokens
        if max_tokens is None or max_tokens <= room:
            return room if max_tokens is None else max_tokens
        if not reject_over_length:
            return room
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of "
            f"the {prompt_param} or completion.",
            max_tokens_param, "context_length_exceeded",
        )


def _checked_lora(lora_request) -> LoRARequest | None:
    """`lora_request` as the engine takes it: a LoRARequest or None (the base model)."""
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError(
            f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
            "lora_request")
    return lora_request

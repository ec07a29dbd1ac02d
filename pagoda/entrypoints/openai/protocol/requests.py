"""Pydantic models of the OpenAI protocol as Pagoda serves it (plus vLLM's extras).

Requests are parsed strictly: `model_validate_json` in strict mode, `extra="forbid"`.
- Strict types: `"5"` is not an int and `true` is not a number; a wrong type is a 400 that
  names the field, never a silent coercion. (JSON ints are accepted for float fields.)
- The field policy (field_policy.py, where the tables are): every field of OpenAI's published
  request schemas is declared here. Those Pagoda honours do what they say; those without
  meaning here (`store`, `metadata`, `user`, `service_tier`, `prompt_cache_key`,
  `verbosity`, ...) are accepted, ignored and named in one warning log line per request;
  those Pagoda cannot honour (`suffix`, audio, `functions`, `moderation`, ...) are accepted
  by the parser and then refused with a 400 that says so (`unsupported_fields`), which is
  clearer than "extra inputs".
- A field in no schema is a 400 ("unknown field", naming it), so a misspelled parameter
  never silently changes nothing.
- vLLM's extras are declared too: its sampling parameters, `echo` on chat (the answer
  continues the last assistant message), `return_tokens_as_token_ids` (logprob tokens as
  "token_id:N") and `prompt_logprobs` (the prompt tokens' logprobs in the response).
Output constraints (`response_format`, vLLM's `guided_*` and `structured_outputs`) live in
structured_fields.py, tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, calls in
messages) in tool_fields.py.

The responses are responses.py's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagoda.entrypoints.openai.protocol.chat_template_fields import (
    ChatReasoningFields,
    ChatTemplateFields,
)
from pagoda.entrypoints.openai.protocol.field_policy import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FieldPolicy,
)
from pagoda.entrypoints.openai.protocol.json_shapes import (
    CHAT_MESSAGE_RULES,
    MessageContent,
    Prompt,
    Stop,
    bounded,
)
from pagoda.entrypoints.openai.protocol.structured_fields import StructuredOutputFields
from pagoda.entrypoints.openai.protocol.tool_fields import (
    MessageToolFields,
    ToolFields,
)
from pagoda.sampling_params import MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    """Send a last chunk with `usage` (and `"usage": null` in every other chunk)."""
    include_obfuscation: bool | None = None
    """OpenAI's; ignored (field_policy.py): Pagoda's chunks carry no obfuscation padding."""
    continuous_usage_stats: bool | None = False
    """vLLM's: with include_usage, every chunk carries `usage` so far (benchmark clients such
    as GuideLLM and AIPerf send it)."""


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


class SamplingRequestFields(StructuredOutputFields, StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means the default.
    The output constraints (response_format, guided_*, structured_outputs) come from
    structured_fields.py."""

    model: str | None = None
    n: int | None = bounded(1, minimum=1, maximum=MAX_N)
    temperature: float | None = bounded(None, minimum=0)
    """Default 1.0, as OpenAI."""
    top_p: float | None = bounded(None, exclusiveMinimum=0, maximum=1)
    stop: Stop = None
    """A string or a list of strings."""
    seed: int | None = None
    presence_penalty: float | None = bounded(0.0, minimum=-2, maximum=2)
    frequency_penalty: float | None = bounded(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    """Token id (a JSON object key, so a string) -> bias in [-100, 100]."""
    user: str | None = None
    """Ignored (field_policy.py)."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = bounded(None, minimum=-1)
    min_p: float | None = bounded(None, minimum=0, maximum=1)
    repetition_penalty: float | None = bounded(None, minimum=1 / MAX_REPETITION_PENALTY,
                                               maximum=MAX_REPETITION_PENALTY)
    min_tokens: int | None = bounded(0, minimum=0)
    ignore_eos: bool | None = False
    priority: int | None = 0
    """Lower runs first when the server uses --scheduling-policy priority."""
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    prompt_logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    """The response carries the prompt tokens' logprobs with this many alternatives, as vLLM
    does: a list per prompt token, null first, then {token id: {logprob, rank,
    decoded_token}}. Not with stream (as in vLLM)."""
    return_tokens_as_token_ids: bool | None = None
    """Logprob tokens are written "token_id:N" (vLLM's), for tokens that are not whole
    UTF-8 text."""

    field_policy: ClassVar[FieldPolicy]
    """What the endpoint does with each OpenAI field (field_policy.py)."""

    @field_validator("stop")
    @classmethod
    def validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to what Pagoda cannot do; the first is a 400."""
        problems = []
        if self.prompt_logprobs is not None and self.stream:
            problems.append(("prompt_logprobs",
                             "prompt_logprobs is not available with stream: true (as in vLLM)"))
        return problems

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's continuous_usage_stats, which needs include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _check_prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], non-empty."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id "
            "lists, and not empty"
        )
    if all(isinstance(p, str) for p in value):
        return value
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in value
    ):
        return value
    raise ValueError(
        "must be a string, a list of strings, a list of token ids or a list of token-id lists"
    )


class CompletionRequest(SamplingRequestFields):
    field_policy: ClassVar[FieldPolicy] = COMPLETION_FIELDS

    prompt: Prompt
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: int | None = bounded(16, minimum=1)
    echo: bool | None = False
    logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    """Logprobs of the sampled token and this many alternatives, in [0, 20]."""
    suffix: str | None = None
    """Not supported (insertion needs a fill-in-the-middle model); refused when set."""
    best_of: int | None = None
    """Only None or equal to n (Pagoda returns every sampled choice)."""

    @field_validator("prompt")
    @classmethod
    def validate_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = super().unsupported_fields()
        if self.suffix:
            problems.append(("suffix", "suffix is not supported: Pagoda does not do insertion"))
        if self.best_of is not None and self.best_of != (self.n or 1):
            problems.append(("best_of", "best_of is not supported (only best_of == n)"))
        return problems


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


def _check_content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"part {i} has type {kind!r}; only text parts ({{'type': 'text', "
                    f"'text': ...}}) are supported"
                )
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError(f"part {i} must be exactly {{'type': 'text', 'text': str}}")
            parts.append(TextContentPart(type="text", text=part["text"]))
        return parts
    raise ValueError("must be a string or a list of {'type': 'text', 'text': ...} parts")


class ChatMessage(MessageToolFields, StrictModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=CHAT_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent = None
    """A string, or a list of text parts (joined with newlines)."""
    name: str | None = None
    refusal: str | None = None
    """Accepted on assistant messages sent back by clients; ignored."""

    @field_validator("content")
    @classmethod
    def validate_content(cls, value: Any) -> Any:
        return _check_content(value)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(ChatReasoningFields, ToolFields, SamplingRequestFields):
    field_policy: ClassVar[FieldPolicy] = CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = bounded(None, minimum=1)
    """Deprecated by OpenAI in favour of max_completion_tokens; either works."""
    max_completion_tokens: int | None = bounded(None, minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    """Alternatives per token in [0, 20]; needs logprobs true."""
    # reasoning_effort, chat_template_kwargs, continue_final_message: chat_template_fields.py
    echo: bool | None = False
    """vLLM's: when the last message is the assistant's, the answer's content starts with it
    (the answer continues it), streamed too."""
    # OpenAI fields without meaning here: accepted, ignored, named in the request's warning.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Accepted by the parser only to be refused with a clear message (when set).
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # vLLM's extras for chat.
    chat_template: str | None = None
    add_generation_prompt: bool | None = True

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = super().unsupported_fields()
        if self.functions:
            problems.append(("functions", "functions are not supported (use tools)"))
        if self.function_call not in (None, "none", "auto"):
            problems.append(("function_call", "function_call is not supported (use tool_choice)"))
        if self.modalities and self.modalities != ["text"]:
            problems.append(("modalities",
                             'modalities: only ["text"] is supported (no audio output)'))
        if self.audio is not None:
            problems.append(("audio", "audio: audio output is not supported"))
        if self.moderation is not None:
            problems.append(("moderation",
                             "moderation is not supported: Pagoda runs no moderation model"))
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs set to true"))
        return problems

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens, the field it came from): max_completion_tokens wins."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(ChatTemplateFields, StrictModel):
    """vLLM's /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None
    """None: True for a prompt, False for messages (their template places special tokens), so
    counts equal the completions' and chats' `prompt_tokens`."""
    return_token_strs: bool | None = False
    chat_template: str | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class LoadModelRequest(StrictModel):
    """POST /v1/models/load (Pagoda's): serve the model file or folder `path` as `model`;
    `path` may be left out to reload a loaded model from where it came."""

    model: str = Field(min_length=1)
    path: str | None = None
    options: dict[str, str | int | float | bool | None] | None = None
    """Engine options by name, as LLM(...) keywords (max_model_len, dtype, ...), each a
    plain value (speculative_config: its JSON text, as on the command line); the server's
    own engine flags fill the rest."""


class UnloadModelRequest(StrictModel):
    """POST /v1/models/unload (Pagoda's)."""

    model: str = Field(min_length=1)


class LoadLoRAAdapterRequest(StrictModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the adapter at `lora_path` (a PEFT folder
    or a GGUF LoRA file inside --lora-allowed-paths) as `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    """Replace an adapter already loaded under that name (vLLM's)."""
    base_model_name: str | None = None
    """Pagoda's: the served model it adapts (default: the server's first model)."""


class UnloadLoRAAdapterRequest(StrictModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    """If given, it must be the adapter's (vLLM's field)."""

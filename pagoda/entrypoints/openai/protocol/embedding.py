"""POST /v1/embeddings: the request and response models (OpenAI's, plus vLLM's `normalize`).

Parsed strictly as protocol.py's requests are (`extra="forbid"`, strict types): an unknown
field or a wrong type is a 400 naming it. `input` is a string, a list of strings, a list of
token ids or a list of token-id lists, none of them empty, at most MAX_INPUTS items (as
OpenAI). What the model decides (`dimensions` allowed or not, the context length) is
checked later, by the engine's InputProcessor (pagoda/pooling_params.py).

The response is OpenAI's shape: `data` holds one embedding per input, in input order, as
floats or (encoding_format "base64") the base64 of its little-endian float32 bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, WithJsonSchema, field_validator

from pagoda.entrypoints.openai.protocol.json_shapes import bounded

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's bound)."""

_STRING = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

EmbeddingInput = Annotated[Any, WithJsonSchema({
    "anyOf": [
        _STRING,
        {"type": "array", "items": _STRING, "minItems": 1, "maxItems": MAX_INPUTS},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS},
    ],
    "description": "A string, a list of strings, a list of token ids, or a list of token-id "
                   f"lists; nothing empty, at most {MAX_INPUTS} inputs.",
})]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_input(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], nothing empty, at most MAX_INPUTS."""
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                         "of token-id lists, and not empty")
    if all(_is_token_id(t) for t in value):
        return value
    if len(value) > MAX_INPUTS:
        raise ValueError(f"holds {len(value)} inputs; at most {MAX_INPUTS} are allowed")
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise ValueError(f"item {value.index('')} is an empty string")
        return value
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value):
        if not all(value):
            raise ValueError(f"item {value.index([])} is an empty list of token ids")
        return value
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of "
                     "token-id lists")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: EmbeddingInput
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """float: lists of numbers; base64: each vector's little-endian float32 bytes, base64."""
    dimensions: int | None = bounded(None, minimum=1)
    """Keep the first `dimensions` values, then renormalise (Matryoshka), where the model
    allows it."""
    user: str | None = None
    """Accepted and ignored (OpenAI's end-user id)."""
    normalize: bool | None = None
    """vLLM's extra: L2-normalise (None: the model's choice, normally yes)."""

    @field_validator("input")
    @classmethod
    def validate_input(cls, value: Any) -> Any:
        return check_input(value)

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one per embedding, in order."""
        value = self.input
        if isinstance(value, str) or _is_token_id(value[0]):
            return [value]
        return list(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or (encoding_format "base64") its little-endian float32 bytes in base64."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

"""Pooling requests (embeddings): what one asks for, and what the model allows.

A pooling request is a prefill-only request: the scheduler computes its prompt like any
other's (chunked, batched with generation traffic), then it finishes without sampling and
its KV blocks are freed at once; the runner hands back one vector, the final hidden state
(after the model's final norm, before the head) pooled over the prompt:

    last   the last prompt token's hidden state (decoder embedding models: Qwen3-Embedding,
           e5-mistral, gte-Qwen2)
    mean   the mean over every prompt token
    cls    the first prompt token's

then cut to `dimensions` (Matryoshka) and L2-normalised when `normalize`.

`PoolingParams` is what a caller gives (vLLM's names); `ModelPooling` is the model's own
choice (sentence-transformers files, GGUF metadata or the --pooling flags: resolved at
start, pagoda/executor/loader/pooling_files.py); `PoolingParams.resolved` fills the one
from the other and checks `dimensions` (InputProcessor, the one validation step). Plain
data, framework-free: it crosses into the runner in NewRequestData.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagoda.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelPooling:
    """How a model pools, resolved once at start (the same for every request)."""

    pooling: str = "last"
    """last, mean or cls."""
    normalize: bool = True
    """L2-normalise the vector (vLLM's default for embedding models)."""
    hidden_size: int = 0
    """Length of a pooled vector before any `dimensions` cut (0: unknown, no cut allowed)."""
    matryoshka: bool = False
    """`dimensions` allowed (config.json's is_matryoshka / matryoshka_dimensions, or the
    --matryoshka flag)."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """The only `dimensions` values allowed, when the model lists them (empty: any size
    from 1 to hidden_size)."""
    source: str = "default"
    """Where `pooling` came from, for the start-up log ("--pooling", "1_Pooling/config.json",
    "GGUF qwen3.pooling_type", "default")."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling!r}")


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for; None fields take the model's choice."""

    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka), then normalise; only where the model
    allows it."""
    normalize: bool | None = None
    """L2-normalise the vector (None: the model's choice, ModelPooling.normalize)."""
    pooling: str | None = None
    """last, mean or cls (None: the model's). The server takes the model's always."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise InvalidRequestError.about(
                "dimensions", f"must be an int >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError.about("normalize", f"must be a bool, got {self.normalize!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise InvalidRequestError.about(
                "pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")

    @property
    def is_resolved(self) -> bool:
        return self.pooling is not None and self.normalize is not None

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read hidden states of positions the prefix cache would skip
        (a cache hit computes nothing there): such requests take no cache hits."""
        return self.pooling != "last"

    def resolved(self, model: ModelPooling) -> PoolingParams:
        """These params with the model's choices filled in; InvalidRequestError naming
        `dimensions` where the model does not allow that value."""
        dimensions = self.dimensions
        if dimensions is not None:
            if not model.matryoshka:
                raise InvalidRequestError.about(
                    "dimensions", "is not supported by this model: its config does not say it "
                    "was trained for Matryoshka truncation (config.json is_matryoshka or "
                    "matryoshka_dimensions); a server started with --matryoshka allows it",
                    "unsupported_parameter")
            if model.matryoshka_dimensions and dimensions not in model.matryoshka_dimensions:
                raise InvalidRequestError.about(
                    "dimensions", f"must be one of {list(model.matryoshka_dimensions)} for this "
                    f"model, got {dimensions}")
            if dimensions > model.hidden_size:
                raise InvalidRequestError.about(
                    "dimensions", f"must be at most the model's embedding size "
                    f"{model.hidden_size}, got {dimensions}")
            if dimensions == model.hidden_size:
                dimensions = None  # the whole vector: nothing to cut
        return replace(
            self, dimensions=dimensions,
            normalize=model.normalize if self.normalize is None else self.normalize,
            pooling=self.pooling or model.pooling,
        )

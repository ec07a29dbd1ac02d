"""What the engine returns per request: RequestOutput holding one CompletionOutput per choice.

Text and token ids are cumulative; the `delta_*` fields hold what is new since the previous
output of the same request, for streaming. A pooling (embedding) request has one output,
finished with reason "stop" and no tokens, and its vector in `RequestOutput.embedding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    """Logprobs of chosen tokens as the executor returns them: row i holds the chosen token
    then the top-N alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    """1-based rank of each chosen token under the model's distribution."""


TokenLogprobDict = dict[int, Logprob]
"""One position: token id -> Logprob, the chosen token first, then the top alternatives."""


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobDict] | None = None
    finish_reason: str | None = None
    """'stop', 'length', 'abort', or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it; None for EOS or length."""
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobDict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprobDict | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    """A pooling request's vector (set on its finished output; None for generation)."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """The pooled vector (cut to its dimensions, normalised as asked)."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        assert output.embedding is not None, "a finished pooling request has its vector"
        return cls(output.request_id, output.prompt_token_ids,
                   EmbeddingOutput(output.embedding), output.finished, output.prompt)

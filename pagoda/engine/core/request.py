"""A request's state as the scheduler sees it: token ids and how many of them are computed.

Invariant: 0 <= num_computed_tokens <= num_tokens = len(prompt_token_ids) + len(output_token_ids).
The scheduler only ever moves num_computed_tokens towards num_tokens (or back to 0 when the
request is preempted); the engine appends sampled tokens to output_token_ids.

A pooling (embedding) request (`pooling_params` set) is the same rule with nothing to
sample: once num_computed_tokens reaches its prompt length the runner returns its vector
and the lifecycle finishes it in that step (its blocks are freed at once).
"""

from __future__ import annotations

import enum
import time

from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Finished states come last so that `is_finished` is one comparison.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids or [])
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        """Output tokens allowed, after capping by the context length."""
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache when first scheduled (-1: not yet)."""
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[int] = []
        """Chained content hashes of this request's full blocks, filled by the block manager."""
        self.first_scheduled_time: float | None = None
        self.spec_token_ids: list[int] = []
        """Proposed next tokens (speculative decoding), verified when next scheduled."""
        self.pooling_params = pooling_params
        """Set for a pooling (embedding) request: prefill only, nothing sampled."""
        self.swap: tuple[list[int], int] | None = None
        """(swap keys, computed tokens) of a request preempted under --preemption-mode swap
        whose blocks wait in the host KV tier; None otherwise."""
        self.kv_loads: tuple[list[int], int, bool] | None = None
        """While the request's blocks are loaded from the KV tiers (one step): (keys, index
        of the first loaded block, whether they are swap entries)."""
        self.lora_request = lora_request
        """The adapter this request runs with (None: the base model); kept through
        preemption, shared by the n children of a parallel-sampling request."""

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (what block hashes and the scheduler's
        --max-loras count key on)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def can_use_prefix_cache(self) -> bool:
        """Whether cached blocks may stand in for computing the start of the prompt: not
        when every prompt position's output is needed (prompt logprobs; mean and CLS
        pooling read the hidden states of every position, or of the first)."""
        if self.sampling_params.prompt_logprobs is not None:
            return False
        return self.pooling_params is None or not self.pooling_params.needs_every_position

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

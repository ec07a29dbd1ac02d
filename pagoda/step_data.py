"""What crosses the boundary between scheduling and execution, once per step: a
`SchedulerOutput` goes down, a `ModelRunnerOutput` comes back. Both are plain data (ints,
lists, SamplingParams): they pickle, so the step can run in another process (a
tensor-parallel worker), and neither side holds the other's live objects.

What the runner is told, and what it remembers itself (its batch state, see
pagoda/executor/input_batch.py):

    new to the batch (first schedule, or resumed after preemption)
        NewRequestData: id, all token ids so far, prompt length, params, block ids,
        tokens already computed (prefix-cache hits)                      -- sent once
    every step
        request_ids + num_scheduled_tokens (batch order), new block ids per request,
        finished ids (drop their state), preempted ids (drop; they come back as new)
        and, for requests under a structured-output grammar that sample this step, their
        rows of the token bitmask (the engine advances the grammars, the runner applies)
        and, with speculative decoding, the proposed tokens each request verifies this step
    never
        the sampled tokens: the runner sampled them, it appends them itself.

KV tiers (--kv-offload-memory, --kv-offload-dir; pagoda/engine/core/kv_offload_index.py): a step may
carry copies between KV-cache blocks and the tiers, run before its forward (saves first: a
block saved may be overwritten by this very step), even in a step with no request; the
runner reports the keys it could not load, its tier counters and the persistent keys the
tiers evicted entirely.

Pooling (embedding) requests carry their PoolingParams in NewRequestData; they sample
nothing (sampled_token_ids None), and the step that computes a prompt's last chunk returns
the pooled vector in ModelRunnerOutput.pooled (the runner keeps the running sum or first
hidden state across chunks itself).

Speculative decoding (pagoda/executor/spec_decode/): the runner's output carries new
proposals per request; the scheduler schedules them after the request's last token (within
the budget) and hands them back in spec_token_ids; the runner verifies them in the step's
forward and reports how many it accepted. A request that verifies k proposals computes
1 + k tokens and emits between 1 and k + 1:

    positions   ... T-1 | T  ...  T+k-1        (T = tokens before the step)
    tokens      last    | d1 ...  dk           logits at each predict the next
    emitted     d1..da accepted, then the sampled token (correction, or bonus if a = k)
    computed    T + a afterwards: the KV of d(a+1)..dk is rolled back (slots freed)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagoda.lora.request import LoRARequest
from pagoda.outputs import TokenLogprobs
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]
    """Prompt, then the output so far (non-empty for a request resumed after preemption)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    """The whole block table as of this step: one list per KV-cache group (runner's order,
    pagoda/engine/core/kv_cache_groups.py; a 1-tuple for a model without sliding-window layers),
    all of the same length."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits) before this step."""
    pooling_params: PoolingParams | None = None
    """Set (resolved) for a pooling request: the runner pools its prompt's final hidden
    states instead of sampling, and returns the vector in ModelRunnerOutput.pooled."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model). The scheduler schedules at
    most --max-loras distinct adapters per step; the runner loads it by lora_path on first
    use and keys it by lora_int_id."""


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    """Requests the runner has not seen (or dropped at preemption); scheduled this step."""
    request_ids: list[str] = field(default_factory=list)
    """Every request that runs this step, in batch order (new ones included)."""
    num_scheduled_tokens: list[int] = field(default_factory=list)
    """Tokens each request computes this step, aligned with request_ids."""
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    """Blocks allocated this step to requests the runner already holds (one list per
    KV-cache group, as in NewRequestData.block_ids; absent: none in any group). Windowed blocks freed because they
    fell out of the window are not announced: the runner's table keeps their stale ids,
    which attention never reads unmasked."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests preempted this step: the runner drops them; they return as new requests."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the previous step: the runner drops their state."""
    grammar_request_ids: list[str] = field(default_factory=list)
    """Requests that sample this step under a structured-output grammar."""
    grammar_bitmask: np.ndarray | None = None
    """(len(grammar_request_ids), ceil(vocab / 32)) int32, aligned with grammar_request_ids:
    bit t of row i set = token t allowed for that request's next token. A request that
    verifies k proposals has k + 1 consecutive rows (its id repeated), one per position."""
    removed_lora_ids: list[int] = field(default_factory=list)
    """Adapters (lora_int_id) removed from the engine (remove_lora) whose last request left
    the scheduler: the runner frees their weights. Each id is sent once."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Proposed tokens each request verifies this step (scheduled after its last token; they
    count in num_scheduled_tokens). Requests without proposals are absent."""

    kv_saves: list[tuple[int, int, bool]] = field(default_factory=list)
    """(key, block id, persistent): copy the pool block to the KV tiers under key, before
    the forward. persistent False: a swap entry (host tier only, never on disk)."""
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    """(key, block id): copy the tiers' entry into the pool block, before the forward (after
    the saves)."""
    kv_drops: list[int] = field(default_factory=list)
    """Keys the tiers may forget (swap entries consumed or given up)."""

    @property
    def has_kv_ops(self) -> bool:
        return bool(self.kv_saves or self.kv_loads or self.kv_drops)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]
    """The step's requests, in batch order (as in the SchedulerOutput)."""
    sampled_token_ids: list[int | None]
    """Aligned with request_ids; None where nothing was sampled (a partial prefill chunk)."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """Per request id that asked for logprobs and sampled this step."""
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """Per request id that asked for prompt logprobs: rows for this chunk's prompt positions."""
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    """Per request that verified proposals: how many of them it accepted (a prefix); they
    come before its sampled token in its output."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """New proposals per request, for the next step (absent: none)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Request id -> why it cannot go on (its logits were not finite): nothing was sampled
    for it; the engine fails that request alone."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Per pooling request whose prompt was completed this step: its embedding (pooled,
    cut to its dimensions, normalised as its PoolingParams say)."""
    kv_load_failures: list[int] = field(default_factory=list)
    """Keys of the step's kv_loads that were missing or corrupt (their blocks left as they
    were: the engine recomputes from the first failed block)."""
    kv_offload_stats: dict[str, int] | None = None
    """The KV tiers' counters since the previous step (KVOffloadWorker.take_stats); None
    without tiers."""
    kv_offload_dropped: list[int] = field(default_factory=list)
    """Persistent keys the tiers evicted from every tier since the previous step."""
    step_executor: str | None = None
    """Which executor ran the step's forward (executor/model_runner.py): "whole-stack",
    "compiled" or "eager"; None for a step with no request."""

"""What the engine publishes after each step: a frozen EngineSnapshot.

Readers outside the engine (/metrics, the async engine's queue checks and failure handling,
the bench, later the web view) read this and nothing else of the engine's state: they
never touch its scheduler, block manager or request lifecycle. Counters are running totals
since start (a reader takes differences); gauges are the state after the step. Request ids
are the callers' ids (a request with n > 1 appears once); sequence counts count each of
its n sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pagoda.engine.stats.request_timeline import RequestTimeline


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class SpecDecodeTotals:
    """Speculative decoding since start, as vLLM counts it: a draft is one request's
    proposals verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    """Drafts whose proposal at position i (0 = first) was accepted."""

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying request gains per step: 1 + accepted per draft (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class SpecDecodeStats:
    """The engine's running spec-decode counts (it publishes SpecDecodeTotals copies)."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def record(self, spec_token_ids: Mapping[str, list[int]],
               num_accepted_tokens: Mapping[str, int]) -> None:
        for request_id, proposals in spec_token_ids.items():
            num_accepted = num_accepted_tokens.get(request_id, 0)
            self.num_drafts += 1
            self.num_draft_tokens += len(proposals)
            self.num_accepted_tokens += num_accepted
            if len(self.accepted_per_position) < len(proposals):
                self.accepted_per_position += [0] * (len(proposals) - len(self.accepted_per_position))
            for position in range(num_accepted):
                self.accepted_per_position[position] += 1

    def frozen(self) -> SpecDecodeTotals:
        return SpecDecodeTotals(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                tuple(self.accepted_per_position))


@dataclass(frozen=True)
class KVOffloadTotals:
    """The KV tiers (pagoda/engine/core/kv_offload_index.py): sizes and gauges after the step, and
    counters since start."""

    host_bytes: int = 0
    """The host tier's size (--kv-offload-memory; 0: no host tier)."""
    disk_bytes: int = 0
    """The disk tier's quota (0: no disk tier)."""
    disk_dir: str | None = None
    num_keys: int = 0
    """Prefix blocks the engine believes the tiers hold (gauge)."""
    swap_bytes: int = 0
    """Bytes of swapped-out requests' blocks waiting in the host tier (gauge)."""
    hit_tokens: int = 0
    """Prompt tokens found in the tiers at admission (loaded instead of computed)."""
    loaded_blocks: int = 0
    failed_loads: int = 0
    """Blocks whose load failed (missing or corrupt): recomputed."""
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_fallbacks: int = 0
    """Preemptions under --preemption-mode swap that recomputed: the host tier had no room."""
    stats: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    """The tiers' own counters (KVOffloadWorker.take_stats names: host_hits, disk_bytes_read,
    corrupt_entries, ...), summed since start."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", _frozen(self.stats))

    def __getstate__(self) -> dict:  # (a read-only proxy does not pickle: a replica sends it)
        return {**self.__dict__, "stats": dict(self.stats)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "stats", _frozen(state["stats"]))


@dataclass(frozen=True)
class EngineSnapshot:
    # ---- gauges: the state after the step -------------------------------------------------
    running_request_ids: tuple[str, ...] = ()
    """Requests with a sequence in the running batch."""
    waiting_request_ids: tuple[str, ...] = ()
    """Requests with a sequence waiting (new, or preempted) and none running."""
    num_tracked_requests: int = 0
    """Requests the engine still holds any state of (0 once all finished and were output)."""
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    """Blocks no request holds (cached prefix blocks among them, reusable)."""
    num_cached_free_kv_blocks: int = 0
    """Free blocks still holding a cached prefix (a subset of num_free_kv_blocks). Counting
    walks the free list, so the engine refreshes it at most 4 times a second."""
    kv_block_size: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks held by requests (0..1, as vLLM's kv_cache_usage_perc)."""
    kv_group_windows: tuple[int | None, ...] = (None,)
    """Sliding window of each KV-cache group, None for full attention: one group unless the
    model has sliding-window layers (then num_kv_blocks etc. above sum over the groups)."""
    kv_group_num_blocks: tuple[int, ...] = ()
    kv_group_num_free_blocks: tuple[int, ...] = ()
    last_step_num_seqs: int = 0
    last_step_num_tokens: int = 0
    last_step_num_prefill_tokens: int = 0
    """Of last_step_num_tokens: tokens of prompts (or of recomputes after preemption)."""
    last_step_num_decode_tokens: int = 0
    """Of last_step_num_tokens: each decoding request's last token and its proposals."""
    num_preempted_seqs: int = 0
    """Waiting sequences that were preempted (a subset of num_waiting_seqs)."""
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters of the running sequences (each once)."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters of the waiting sequences (each once)."""
    max_lora: int = 0
    """--max-loras, 0 with LoRA off (vLLM's lora_requests_info label max_lora)."""
    request_timelines: tuple[RequestTimeline, ...] = ()
    """Recent sequences' timelines: the last finished ones, then those in flight
    (request_timeline.py; bounded)."""
    # ---- counters: running totals since start ---------------------------------------------
    num_steps: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of every sequence added."""
    num_computed_prompt_tokens: int = 0
    """Prompt tokens run through the model (cache hits excluded, recomputes included)."""
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Prompt tokens served from the prefix cache."""
    num_preemptions: int = 0
    num_structured_requests: int = 0
    """Requests added with a structured-output constraint."""
    grammar_compile_seconds: float = 0.0
    """Time spent compiling structured-output grammars (cache misses only)."""
    batch_sizes: Mapping[int, int] = field(default_factory=lambda: _frozen({}))
    """Sequences per step -> number of steps."""
    finished_by_reason: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    """Finished sequences by reason: stop, length, abort."""
    steps_by_executor: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    """Model steps by the executor that ran their forward (executor/model_runner.py):
    "whole-stack" (the C decode step), "compiled" or "eager"."""
    spec_decode: SpecDecodeTotals = field(default_factory=SpecDecodeTotals)
    """Speculative decoding counts (all zero when it is off)."""
    kv_offload: KVOffloadTotals | None = None
    """The KV tiers below the KV cache (--kv-offload-memory / --kv-offload-dir); None: off."""

    def __post_init__(self) -> None:
        # a read-only copy: the engine goes on counting in its own mappings
        object.__setattr__(self, "batch_sizes", _frozen(self.batch_sizes))
        object.__setattr__(self, "finished_by_reason", _frozen(self.finished_by_reason))
        object.__setattr__(self, "steps_by_executor", _frozen(self.steps_by_executor))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.kv_block_size

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running_request_ids) + len(self.waiting_request_ids)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.running_request_ids or self.waiting_request_ids)

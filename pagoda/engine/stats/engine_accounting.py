"""The engine's accounting: what LLMEngine counts and times as requests come, run and finish,
and the frozen EngineSnapshot (snapshot.py) built from it and from the scheduler's, the
block manager's and the lifecycle's state after each step, add or abort.

The engine thread is the only writer; readers take the snapshot. Counters only grow (the
metrics take their deltas, metrics.py). Nothing here decides anything: the step
(llm_engine.py) calls these after it acted.
"""

from __future__ import annotations

import time
from collections import Counter

from pagoda.config import EngineConfig
from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.kv_offload_index import KVOffloadIndex
from pagoda.engine.core.lifecycle import RequestLifecycle
from pagoda.engine.core.lora_adapters import LoRAAdapters
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.stats.request_timeline import RequestTimelines
from pagoda.engine.stats.snapshot import EngineSnapshot, KVOffloadTotals, SpecDecodeStats
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput

CACHED_FREE_REFRESH_S = 0.25


class EngineAccounting:
    """Counters, request timelines and the snapshot of one LLMEngine (which owns the parts
    read here and hands them over at its construction)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, block_manager: KVCacheManager,
                 lifecycle: RequestLifecycle, loras: LoRAAdapters,
                 kv_offload: KVOffloadIndex | None, grammar_compiler: GrammarCompiler | None) -> None:
        self._config = config
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._lifecycle = lifecycle
        self._loras = loras
        self._kv_offload = kv_offload
        self._grammar_compiler = grammar_compiler
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_structured_requests = 0
        self._batch_sizes: Counter = Counter()
        self._finished_by_reason: Counter = Counter()
        self._steps_by_executor: Counter = Counter()
        self._last_step = (0, 0, 0)  # (sequences, tokens, prefill tokens among them)
        self._timelines = RequestTimelines()
        self._num_cached_free_blocks = 0
        self._cached_free_counted_at = float("-inf")  # time.monotonic()
        self._spec_stats = SpecDecodeStats()

    # ---- events ----------------------------------------------------------------------------

    def structured_request_added(self) -> None:
        """A request under a grammar was queued."""
        self._num_structured_requests += 1

    def sequence_added(self, sequence: Request) -> None:
        """A sequence of a new request was queued (n of them for n > 1)."""
        self._num_prompt_tokens += sequence.num_prompt_tokens
        self._timelines.add(sequence.request_id, sequence.arrival_time,
                            sequence.num_prompt_tokens)

    def aborted(self, finished: list[Request], now: float) -> None:
        """Sequences their caller (or the engine, for their own fault) stopped."""
        self._finished_by_reason["abort"] += len(finished)
        for request in finished:
            self._timelines.finish(request.request_id, now, "abort", request.num_output_tokens)

    def preempted(self, sequence_ids: list[str]) -> None:
        self._timelines.preempted(sequence_ids)

    def speculated(self, scheduler_output: SchedulerOutput,
                   runner_output: ModelRunnerOutput) -> None:
        """The step's proposals and how many of each were accepted."""
        self._spec_stats.record(scheduler_output.spec_token_ids, runner_output.num_accepted_tokens)

    def prefill_chunks(self, scheduler_output: SchedulerOutput) -> list[tuple[Request, int]]:
        """(request, tokens) of the step's prefill work, read before the step advances the
        requests: a request computing known tokens other than its last one (its prompt, or
        prompt + output again after a preemption), or one with no output yet. The rest are
        decodes: the last token, plus proposals under speculative decoding."""
        requests = self._scheduler.requests
        chunks = []
        for request_id, num_tokens in zip(scheduler_output.request_ids,
                                          scheduler_output.num_scheduled_tokens):
            request = requests[request_id]
            if request.num_computed_tokens + 1 < request.num_tokens or not request.output_token_ids:
                chunks.append((request, num_tokens))
        return chunks

    def prefilled(self, prefill: list[tuple[Request, int]], step_start: float,
                  now: float) -> None:
        """The step's prefill chunks (prefill_chunks) ran; those with output have their first
        token. Before the step's finishes (a record leaves the in-flight set there)."""
        self._timelines.record_prefill([(r.request_id, n) for r, n in prefill], step_start, now)
        self._timelines.record_first_tokens(
            [r.request_id for r, _ in prefill if r.output_token_ids], now)

    def finished(self, sequence_id: str, freed: list[Request], status: RequestStatus,
                 now: float) -> None:
        """A sequence the lifecycle stopped (`freed`: what the scheduler freed of it)."""
        for request in freed:
            self._timelines.finish(sequence_id, now, status.finish_reason,
                                   request.num_output_tokens)
        self._finished_by_reason[status.finish_reason] += 1

    def step_done(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                  prefill: list[tuple[Request, int]]) -> None:
        """A step with a batch ran to its end."""
        self._num_steps += 1
        self._steps_by_executor[runner_output.step_executor] += 1
        num_seqs = len(scheduler_output.request_ids)
        self._batch_sizes[num_seqs] += 1
        self._last_step = (num_seqs, scheduler_output.total_num_scheduled_tokens,
                           sum(n for _, n in prefill))

    # ---- the snapshot ----------------------------------------------------------------------

    def _kv_offload_totals(self) -> KVOffloadTotals | None:
        kv_offload, cache = self._kv_offload, self._config.cache
        if kv_offload is None:
            return None
        return KVOffloadTotals(
            host_bytes=cache.kv_offload_memory,
            disk_bytes=cache.kv_offload_disk_bytes if cache.kv_offload_dir else 0,
            disk_dir=cache.kv_offload_dir, num_keys=len(kv_offload.keys),
            swap_bytes=kv_offload.swap_bytes_used, hit_tokens=kv_offload.hit_tokens,
            loaded_blocks=kv_offload.loaded_blocks, failed_loads=kv_offload.failed_loads,
            swapped_out_blocks=kv_offload.swapped_out_blocks,
            swapped_in_blocks=kv_offload.swapped_in_blocks, swap_fallbacks=kv_offload.swap_fallbacks,
            stats=kv_offload.stats,
        )

    def _count_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix: a walk of the free list, so it is
        redone at most every CACHED_FREE_REFRESH_S (the snapshot's figure may lag)."""
        now = time.monotonic()
        if now - self._cached_free_counted_at >= CACHED_FREE_REFRESH_S:
            self._num_cached_free_blocks = self._block_manager.num_cached_free_blocks
            self._cached_free_counted_at = now
        return self._num_cached_free_blocks

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now, frozen. One field per line of what the snapshot holds:
        longer than ~60 lines would be, but it reads as the table it is."""
        scheduler, blocks, lifecycle = self._scheduler, self._block_manager, self._lifecycle
        running = dict.fromkeys(lifecycle.parent_id(r.request_id) for r in scheduler.running)
        waiting = dict.fromkeys(
            parent for parent in (lifecycle.parent_id(r.request_id) for r in scheduler.waiting)
            if parent not in running
        )
        return EngineSnapshot(
            running_request_ids=tuple(running),
            waiting_request_ids=tuple(waiting),
            num_tracked_requests=len(lifecycle.parents),
            num_running_seqs=scheduler.num_running,
            num_waiting_seqs=scheduler.num_waiting,
            num_kv_blocks=blocks.num_blocks,
            num_free_kv_blocks=blocks.num_free_blocks,
            kv_block_size=blocks.block_size,
            kv_cache_usage=blocks.usage,
            kv_group_windows=tuple(blocks.windows),
            kv_group_num_blocks=tuple(group.num_blocks for group in blocks.groups),
            kv_group_num_free_blocks=tuple(group.num_free_blocks for group in blocks.groups),
            last_step_num_seqs=self._last_step[0],
            last_step_num_tokens=self._last_step[1],
            last_step_num_prefill_tokens=self._last_step[2],
            last_step_num_decode_tokens=self._last_step[1] - self._last_step[2],
            num_preempted_seqs=sum(r.status == RequestStatus.PREEMPTED for r in scheduler.waiting),
            num_cached_free_kv_blocks=self._count_cached_free_blocks(),
            request_timelines=self._timelines.published,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
            num_generation_tokens=lifecycle.num_output_tokens,
            prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            num_structured_requests=self._num_structured_requests,
            grammar_compile_seconds=(
                self._grammar_compiler.compile_seconds if self._grammar_compiler else 0.0),
            batch_sizes=self._batch_sizes,
            finished_by_reason=self._finished_by_reason,
            steps_by_executor=self._steps_by_executor,
            spec_decode=self._spec_stats.frozen(),
            kv_offload=self._kv_offload_totals(),
            running_lora_adapters=self._loras.names(scheduler.running),
            waiting_lora_adapters=self._loras.names(scheduler.waiting),
            max_lora=self._config.lora.max_loras if self._config.lora.enable_lora else 0,
        )

"""The synchronous engine core, a black box: add_request / abort_request / step, plus the
frozen EngineSnapshot it publishes after each step (snapshot.py). Built by
`pagoda.engine.builder.build_engine(config)`.

Each `step()`:

    scheduler.schedule()            who runs, how many tokens       -> SchedulerOutput (plain)
    runner.execute_model(...)       one forward + sampling          -> ModelRunnerOutput (plain)
    scheduler.update_from_output    computed counts, tokens appended
    lifecycle.process_step          every stop rule                  -> sequences to finish
    scheduler.finish_requests       their blocks freed
    lifecycle.make_outputs          RequestOutputs for the requests that progressed

The runner is reached only through `execute_model` and plain data, so it may live in
another process (tests/engine/test_step_boundary.py runs it in one).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pagoda.config import EngineConfig
from pagoda.engine.grammar import GrammarCompiler
from pagoda.engine.input_processor import EngineRequest, InputProcessor
from pagoda.engine.kv_cache_groups import KVCacheManager
from pagoda.engine.kv_tier_index import KVTierIndex
from pagoda.engine.lifecycle import RequestLifecycle
from pagoda.engine.lora_adapters import LoRAAdapters
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.request_timeline import RequestTimelines
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.snapshot import EngineSnapshot, KVOffloadTotals, SpecDecodeStats
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import ModelPooling, PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

CACHED_FREE_REFRESH_S = 0.25


class StepRunner(Protocol):
    """What the engine needs of the execution layer (ModelRunner, or a proxy to a worker)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class BatchFailedError(RuntimeError):
    """The forward of a step raised; the requests of its batch were aborted (`request_ids`)
    and the engine goes on serving the others."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: StepRunner,
        tokenizer,
        eos_token_ids: list[int],
        *,
        max_model_len: int,
        num_blocks: Sequence[int],
        vocab_size: int,
        model_files=None,
        hf_config=None,
        grammar_compiler: GrammarCompiler | None = None,
        kv_cache_windows: Sequence[int | None] = (None,),
        run_info: dict | None = None,
        model_pooling: ModelPooling | None = None,
        kv_block_bytes: int = 0,
    ) -> None:
        """Built by builder.build_engine. `grammar_compiler` serves structured outputs
        (None: such requests are refused). `num_blocks` and `kv_cache_windows`: the number
        of blocks and the sliding window (None: full attention) of each KV-cache group, in
        the runner's order; the default is one full-attention group. `run_info`: the
        runner's device, CPU, dtypes and kernels (cpu_info.run_info), for GET /version.
        `kv_block_bytes`: one KV block's bytes (all layers), what a swapped-out block takes
        in the host KV tier. With KV tiers configured the runner must have created its
        KVOffloadWorker (ModelRunner.attach_kv_offload); its known keys seed the index."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.model_files = model_files
        self.hf_config = hf_config
        self.device = getattr(runner, "device", None)
        self.dtype = getattr(runner, "dtype", None)
        self.grammar_compiler = grammar_compiler
        self.run_info: dict = dict(run_info or {})
        self.model_pooling = model_pooling
        self.input_processor = InputProcessor(tokenizer, vocab_size, max_model_len,
                                              grammar_compiler, model_pooling)
        self._block_manager = KVCacheManager(
            list(num_blocks), config.cache.block_size, list(kv_cache_windows),
            config.cache.enable_prefix_caching,
        )
        self._kv_tiers: KVTierIndex | None = None
        if config.cache.kv_offload_enabled:
            self._kv_tiers = KVTierIndex(config.cache.kv_offload_memory, kv_block_bytes)
            self._block_manager.attach_tiers(self._kv_tiers)
            known = runner.kv_offload_known_keys()
            self._kv_tiers.seed(known)
            if known:
                logger.info("KV disk tier: %d blocks of earlier runs found", len(known))
        self._loras = LoRAAdapters(config.lora.enable_lora, config.lora.max_loras)
        self._scheduler = Scheduler(config.scheduler, self._block_manager, max_model_len,
                                    self._loras)
        self._lifecycle = RequestLifecycle(tokenizer, eos_token_ids, max_model_len,
                                           grammar_compiler)
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_structured_requests = 0
        self._batch_sizes: Counter = Counter()
        self._finished_by_reason: Counter = Counter()
        self._steps_by_executor: Counter = Counter()
        self._failed_requests: dict[str, str] = {}
        """Requests the engine stopped for a fault of their own (take_failed_requests)."""
        self._last_step = (0, 0, 0)  # (sequences, tokens, prefill tokens among them)
        self._timelines = RequestTimelines()
        self._num_cached_free_blocks = 0
        self._cached_free_counted_at = float("-inf")  # time.monotonic()
        self._spec_stats = SpecDecodeStats()
        self._snapshot = self._take_snapshot()

    @property
    def kv_capacity_tokens(self) -> int:
        return self._snapshot.kv_capacity_tokens

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate (InputProcessor) and queue a request. `prompt` is text (tokenized here
        unless `prompt_token_ids` is given) or token ids; PoolingParams make it a pooling
        (embedding) request; `lora_request` runs it with that adapter (None: the base
        model). Raises InvalidRequestError (a ValueError) for a bad request or a request id
        already in use."""
        if isinstance(params, PoolingParams):
            request = self.input_processor.process_pooling(
                request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                arrival_time=arrival_time, priority=priority, prompt_param="prompt",
                lora_request=lora_request)
        else:
            request = self.input_processor.process(
                request_id, prompt, params or SamplingParams(), prompt_token_ids=prompt_token_ids,
                arrival_time=arrival_time, priority=priority, lora_request=lora_request,
            )
        self.add_engine_request(request)

    def add_engine_request(self, request: EngineRequest) -> None:
        """Queue a request validated by `input_processor` (the async engine validates on its
        event loop, then hands the result over)."""
        if self._lifecycle.has_request(request.request_id):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._loras.check(request.lora_request)
        if request.grammar is not None:
            self._num_structured_requests += 1
        for sequence in self._lifecycle.add_request(request):
            self._scheduler.add_request(sequence)
            self._num_prompt_tokens += sequence.num_prompt_tokens
            self._timelines.add(sequence.request_id, sequence.arrival_time,
                                sequence.num_prompt_tokens)
        self._snapshot = self._take_snapshot()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests (by the ids given to add_request) and free their KV blocks; unknown
        or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            sequence_ids = self._lifecycle.abort(request_id)
            finished = self._scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
            self._finished_by_reason["abort"] += len(finished)
            for request in finished:
                self._timelines.finish(request.request_id, time.time(), "abort",
                                       request.num_output_tokens)
        self._snapshot = self._take_snapshot()

    # ---- LoRA adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) ---------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Know an adapter ahead of its requests (its weights load on first use); False if
        known already. Raises InvalidRequestError with LoRA off, for an id taken by another
        adapter, or for one being removed."""
        return self._loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove an adapter: new requests naming it are refused at once; those in flight
        finish; then the runner frees its weights (SchedulerOutput.removed_lora_ids, in the
        next step). False for an adapter the engine does not know."""
        removed = self._loras.remove(lora_int_id)
        self._snapshot = self._take_snapshot()
        return removed

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters known (added, or named by a request) and not
        removed."""
        return self._loras.list()

    def shutdown(self) -> None:
        """Write the KV cache's prefix blocks to the disk tier (if there is one), then stop
        the runner's worker processes, if it has any (tensor parallelism)."""
        if self._kv_tiers is not None and self.config.cache.kv_offload_dir is not None:
            try:
                self.runner.kv_offload_flush(self._block_manager.cached_block_items())
            except Exception:
                logger.exception("flushing the KV cache to the disk tier failed")
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or an adapter removal the runner has yet to hear
        of (one step, with an empty batch, tells it)."""
        return self._scheduler.has_unfinished_requests() or self._loras.has_pending_removal

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefix blocks (as vLLM's); False if blocks are in use."""
        return self._block_manager.reset_prefix_cache()

    def snapshot(self) -> EngineSnapshot:
        """The state after the last step, add or abort (frozen; safe to hand to any thread)."""
        return self._snapshot

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the RequestOutputs of the requests that progressed. Raises
        BatchFailedError if the forward failed (that batch's requests are then aborted)."""
        step_start = time.time()
        scheduler_output = self._scheduler.schedule()
        if scheduler_output.preempted_request_ids:
            self._timelines.preempted(scheduler_output.preempted_request_ids)
        if (scheduler_output.is_empty and not scheduler_output.finished_request_ids
                and not scheduler_output.removed_lora_ids and not scheduler_output.has_kv_ops):
            return []
        prefill = self._prefill_chunks(scheduler_output)
        if not scheduler_output.is_empty and self._lifecycle.num_grammar_sequences:
            self._add_grammar_bitmask(scheduler_output)
        try:
            # (An empty batch still goes down: the runner drops the finished requests and
            # frees the removed adapters.)
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as e:
            self._scheduler.update_kv_from_output(None)  # (its loads count as failed)
            raise self._abort_batch(scheduler_output, e) from e
        self._scheduler.update_kv_from_output(runner_output)
        if scheduler_output.is_empty:
            if scheduler_output.has_kv_ops:  # (a step of loads and saves alone)
                self._snapshot = self._take_snapshot()
            return []
        if runner_output.failed:
            self._fail_sequences(runner_output.failed)
        self._spec_stats.record(scheduler_output.spec_token_ids, runner_output.num_accepted_tokens)
        new_tokens = self._scheduler.update_from_output(scheduler_output, runner_output)
        now = time.time()
        finished = self._lifecycle.process_step(new_tokens, runner_output, now)
        if prefill:  # (before the finishes below: a record leaves the in-flight set there)
            self._timelines.record_prefill([(r.request_id, n) for r, n in prefill], step_start, now)
            self._timelines.record_first_tokens(
                [r.request_id for r, _ in prefill if r.output_token_ids], now)
        for sequence_id, status in finished:
            for request in self._scheduler.finish_requests([sequence_id], status):
                self._timelines.finish(sequence_id, now, status.finish_reason,
                                       request.num_output_tokens)
            self._finished_by_reason[status.finish_reason] += 1
        if runner_output.spec_token_ids and self._lifecycle.num_grammar_sequences:
            self._keep_grammar_valid_proposals(runner_output.spec_token_ids)
        self._fail_sequences(self._lifecycle.take_failed())  # grammar or detokenizer faults
        self._num_steps += 1
        self._steps_by_executor[runner_output.step_executor] += 1
        num_seqs = len(scheduler_output.request_ids)
        self._batch_sizes[num_seqs] += 1
        self._last_step = (num_seqs, scheduler_output.total_num_scheduled_tokens,
                           sum(n for _, n in prefill))
        outputs = self._lifecycle.make_outputs()
        self._snapshot = self._take_snapshot()
        return outputs

    def _prefill_chunks(self, scheduler_output: SchedulerOutput) -> list[tuple[Request, int]]:
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

    def _fail_sequences(self, failed: dict[str, str]) -> None:
        """Abort the requests of sequences that failed on their own (the runner: non-finite
        logits; the lifecycle: an exception in their grammar or detokenization); their
        reasons wait in take_failed_requests() (the other requests of the step go on)."""
        for sequence_id, reason in failed.items():
            parent = self._lifecycle.parent_id(sequence_id)
            if parent is not None and parent not in self._failed_requests:
                self._failed_requests[parent] = reason
                self.abort_request(parent)

    def _keep_grammar_valid_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Cut each sequence's new proposals to what its grammar allows (after this step's
        tokens advanced it): proposals are masked by the grammar too."""
        for sequence_id in proposals:
            request = self._scheduler.requests.get(sequence_id)
            if request is not None and request.spec_token_ids:
                request.spec_token_ids = self._lifecycle.grammar_valid_proposals(
                    sequence_id, request.spec_token_ids)

    def take_failed_requests(self) -> dict[str, str]:
        """Requests (add_request ids) failed since the last call, with the reason: aborted
        by the engine, not by their caller, whose outputs end "abort". Callers report them
        as errors (AsyncLLMEngine, LLM)."""
        failed, self._failed_requests = self._failed_requests, {}
        return failed

    def _add_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Bitmask rows for the sequences under a grammar that sample this step (those whose
        scheduled tokens reach their end, proposals included), one per verified position."""
        spec = scheduler_output.spec_token_ids
        sampling = [
            request_id for request_id, num in zip(
                scheduler_output.request_ids, scheduler_output.num_scheduled_tokens)
            if (request := self._scheduler.requests[request_id]).num_computed_tokens + num
            == request.num_tokens + len(spec.get(request_id, ()))
        ]
        ids, bitmask = self._lifecycle.fill_grammar_bitmask(sampling, self.vocab_size, spec)
        scheduler_output.grammar_request_ids = ids
        scheduler_output.grammar_bitmask = bitmask

    def _abort_batch(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> BatchFailedError:
        parent_ids = list(dict.fromkeys(
            parent for parent in map(self._lifecycle.parent_id, scheduler_output.request_ids)
            if parent is not None
        ))
        self.abort_request(parent_ids)
        return BatchFailedError(parent_ids, error)

    def _kv_offload_totals(self) -> KVOffloadTotals | None:
        tiers, cache = self._kv_tiers, self.config.cache
        if tiers is None:
            return None
        return KVOffloadTotals(
            host_bytes=cache.kv_offload_memory,
            disk_bytes=cache.kv_offload_disk_bytes if cache.kv_offload_dir else 0,
            disk_dir=cache.kv_offload_dir, num_keys=len(tiers.keys),
            swap_bytes=tiers.swap_bytes_used, hit_tokens=tiers.hit_tokens,
            loaded_blocks=tiers.loaded_blocks, failed_loads=tiers.failed_loads,
            swapped_out_blocks=tiers.swapped_out_blocks,
            swapped_in_blocks=tiers.swapped_in_blocks, swap_fallbacks=tiers.swap_fallbacks,
            stats=tiers.stats,
        )

    def _count_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix: a walk of the free list, so it is
        redone at most every CACHED_FREE_REFRESH_S (the snapshot's figure may lag)."""
        now = time.monotonic()
        if now - self._cached_free_counted_at >= CACHED_FREE_REFRESH_S:
            self._num_cached_free_blocks = self._block_manager.num_cached_free_blocks
            self._cached_free_counted_at = now
        return self._num_cached_free_blocks

    def _take_snapshot(self) -> EngineSnapshot:
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
                self.grammar_compiler.compile_seconds if self.grammar_compiler else 0.0),
            batch_sizes=self._batch_sizes,
            finished_by_reason=self._finished_by_reason,
            steps_by_executor=self._steps_by_executor,
            spec_decode=self._spec_stats.frozen(),
            kv_offload=self._kv_offload_totals(),
            running_lora_adapters=self._loras.names(scheduler.running),
            waiting_lora_adapters=self._loras.names(scheduler.waiting),
            max_lora=self.config.lora.max_loras if self.config.lora.enable_lora else 0,
        )

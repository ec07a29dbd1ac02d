"""The synchronous engine core, a black box: add_request / abort_request / step, plus the
frozen EngineSnapshot it publishes after each step (snapshot.py; the counters and
timelines behind it are engine_accounting.py's). Built by
`pagoda.engine.loop.builder.build_engine(config)`.

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
from collections.abc import Sequence
from typing import Protocol

from pagoda.config import EngineConfig
from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.kv_offload_index import KVOffloadIndex
from pagoda.engine.core.lifecycle import RequestLifecycle
from pagoda.engine.core.lora_adapters import LoRAAdapters
from pagoda.engine.core.request import RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.stats.engine_accounting import EngineAccounting
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import ModelPooling, PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


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
        KVOffloadWorker (runner_builder.attach_kv_offload); its known keys seed the index."""
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
        self._kv_offload = (self._attach_kv_offload(kv_block_bytes)
                            if config.cache.kv_offload_enabled else None)
        self._loras = LoRAAdapters(config.lora.enable_lora, config.lora.max_loras)
        self._scheduler = Scheduler(config.scheduler, self._block_manager, max_model_len,
                                    self._loras)
        self._lifecycle = RequestLifecycle(tokenizer, eos_token_ids, max_model_len,
                                           grammar_compiler)
        self._failed_requests: dict[str, str] = {}
        """Requests the engine stopped for a fault of their own (take_failed_requests)."""
        self._accounting = EngineAccounting(config, self._scheduler, self._block_manager,
                                            self._lifecycle, self._loras, self._kv_offload,
                                            grammar_compiler)
        self._snapshot = self._accounting.snapshot()

    def _attach_kv_offload(self, kv_block_bytes: int) -> KVOffloadIndex:
        """The KV tiers' index under the block manager, seeded with the keys the runner's
        tiers hold at start (the disk tier's entries of earlier runs)."""
        kv_offload = KVOffloadIndex(self.config.cache.kv_offload_memory, kv_block_bytes)
        self._block_manager.attach_kv_offload(kv_offload)
        known = self.runner.kv_offload_known_keys()
        kv_offload.seed(known)
        if known:
            logger.info("KV disk tier: %d blocks of earlier runs found", len(known))
        return kv_offload

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
            self._accounting.structured_request_added()
        for sequence in self._lifecycle.add_request(request):
            self._scheduler.add_request(sequence)
            self._accounting.sequence_added(sequence)
        self._snapshot = self._accounting.snapshot()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests (by the ids given to add_request) and free their KV blocks; unknown
        or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            sequence_ids = self._lifecycle.abort(request_id)
            finished = self._scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
            self._accounting.aborted(finished, time.time())
        self._snapshot = self._accounting.snapshot()

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
        self._snapshot = self._accounting.snapshot()
        return removed

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters known (added, or named by a request) and not
        removed."""
        return self._loras.list()

    def shutdown(self) -> None:
        """Write the KV cache's prefix blocks to the disk tier (if there is one), then stop
        the runner's worker processes, if it has any (tensor parallelism)."""
        if self._kv_offload is not None and self.config.cache.kv_offload_dir is not None:
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
            self._accounting.preempted(scheduler_output.preempted_request_ids)
        if (scheduler_output.is_empty and not scheduler_output.finished_request_ids
                and not scheduler_output.removed_lora_ids and not scheduler_output.has_kv_ops):
            return []
        prefill = self._accounting.prefill_chunks(scheduler_output)
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
                self._snapshot = self._accounting.snapshot()
            return []
        if runner_output.failed:
            self._fail_sequences(runner_output.failed)
        self._accounting.speculated(scheduler_output, runner_output)
        new_tokens = self._scheduler.update_from_output(scheduler_output, runner_output)
        now = time.time()
        finished = self._lifecycle.process_step(new_tokens, runner_output, now)
        if prefill:  # (before the finishes below: a record leaves the in-flight set there)
            self._accounting.prefilled(prefill, step_start, now)
        for sequence_id, status in finished:
            self._accounting.finished(
                sequence_id, self._scheduler.finish_requests([sequence_id], status), status, now)
        if runner_output.spec_token_ids and self._lifecycle.num_grammar_sequences:
            self._keep_grammar_valid_proposals(runner_output.spec_token_ids)
        self._fail_sequences(self._lifecycle.take_failed())  # grammar or detokenizer faults
        self._accounting.step_done(scheduler_output, runner_output, prefill)
        outputs = self._lifecycle.make_outputs()
        self._snapshot = self._accounting.snapshot()
        return outputs

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

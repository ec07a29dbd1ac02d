"""The synchronous engine core: add_request / step / abort_request.

Each `step()` is: schedule -> one forward of the whole batch -> update request states ->
detokenize and check stop strings -> RequestOutputs for the requests that progressed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from pagoda.config import EngineConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import Scheduler
from pagoda.executor.kernels.cpu_info import describe_run
from pagoda.executor.layers.quantization import QuantizedLinear
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import (
    load_model,
    open_checkpoint,
    resolve_device,
    resolve_dtype,
    set_cpu_threads,
)
from pagoda.executor.loader.tokenizer import eos_token_ids, load_tokenizer
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.models.registry import resolve_model_class
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Running totals since start; read by tests, the bench tool and /metrics."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of every request added."""
    num_computed_prompt_tokens: int = 0
    """Prompt tokens actually run through the model (cache hits excluded, recomputes included)."""
    num_generation_tokens: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    """Requests per step -> number of steps."""
    finished_by_reason: Counter = field(default_factory=Counter)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config
        files = resolve_model_files(config.model.model)
        tokenizer_files = resolve_model_files(config.model.tokenizer) if config.model.tokenizer else files
        self.model_files = files
        checkpoint = open_checkpoint(files)  # before the tokenizer: clearer errors on bad files
        resolve_model_class(checkpoint.hf_config)  # an unsupported architecture fails here
        self.tokenizer = load_tokenizer(tokenizer_files)
        hf_config = checkpoint.hf_config
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if self.device.type == "cpu":
            logger.info("%d CPU threads", set_cpu_threads())
        context_len = int(getattr(hf_config, "max_position_embeddings", 2048))
        max_model_len = config.model.max_model_len or context_len
        if max_model_len > context_len:
            raise ValueError(
                f"max_model_len {max_model_len} is longer than the model's context length "
                f"{context_len}"
            )
        torch.manual_seed(config.model.seed)
        model = load_model(
            checkpoint, self.dtype, self.device, max_position=max_model_len,
            quantization=config.model.quantization,
        )
        self.eos_token_ids = eos_token_ids(files, self.tokenizer, hf_config)
        self.runner = ModelRunner(model, self.device, self.dtype, config.cache, self.eos_token_ids)
        if self.device.type == "cpu":
            quantization = next((m.method for m in model.model.modules()
                                 if isinstance(m, QuantizedLinear)), None)
            logger.info(describe_run(self.dtype, quantization, self.runner.backend.name))
        num_blocks = self.runner.determine_num_blocks(max_model_len, config.scheduler)
        capacity = num_blocks * config.cache.block_size
        if capacity < max_model_len:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                    f"{max_model_len}; give it more memory or lower max_model_len"
                )
            logger.warning("max_model_len lowered from %d to the KV capacity %d", max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        if not config.scheduler.enable_chunked_prefill and (
            config.scheduler.max_num_batched_tokens < max_model_len
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens "
                f"({config.scheduler.max_num_batched_tokens}) must be at least max_model_len "
                f"({max_model_len}), or long prompts could never be scheduled"
            )
        self.runner.initialize_kv_cache(num_blocks)
        if config.model.compile:
            start = time.perf_counter()
            sizes = self.runner.compile_model()
            logger.info("compiled the model for steps of %s tokens in %.0f s",
                        ", ".join(map(str, sizes)), time.perf_counter() - start)
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.vocab_size = int(hf_config.vocab_size)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; max_model_len %d",
            num_blocks, config.cache.block_size, capacity, max_model_len,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # ---- requests --------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is out of range; ids must be in [0, {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens, but the maximum model length is "
                f"{self.max_model_len} tokens (room is needed for at least one output token)"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. `prompt` is text (tokenized here unless `prompt_token_ids` is
        given) or token ids. Raises ValueError for an empty or too-long prompt, bad token ids,
        or a duplicate request id."""
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize_prompt(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.validate_prompt(prompt_token_ids)
        params.verify_token_ids(self.vocab_size)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival_time = time.time() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params,
            child_ids, arrival_time,
        )
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Each choice gets its own seed, or all n would be the same text.
                child_params = params.clone()
                child_params.seed = params.seed + index
            self.scheduler.add_request(
                Request(
                    child_id, prompt_token_ids, child_params, self.eos_token_ids,
                    arrival_time=arrival_time, priority=priority, max_tokens=max_tokens,
                )
            )
        self.stats.num_prompt_tokens += len(prompt_token_ids) * len(child_ids)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests (by the id given to add_request) and free their KV blocks."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)
            self.stats.finished_by_reason["abort"] += len(children)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self._count_computed_prompt_tokens(scheduler_output)
        runner_output = self.runner.execute_model(scheduler_output)
        for request_id, logprobs in runner_output.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(request_id, logprobs)
        new_tokens = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids
        )
        now = time.time()
        stopped = []
        for request, token_id in new_tokens:
            stop = self.output_processor.add_token(
                request, token_id, runner_output.logprobs.get(request.request_id), now
            )
            if stop is not None:
                stopped.append(request)
                request.stop_reason = stop
                if not request.is_finished:
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished:
                reason = request.status.finish_reason
                self.output_processor.finish(request, reason, request.stop_reason)
                self.stats.finished_by_reason[reason] += 1
        self.stats.num_steps += 1
        self.stats.num_generation_tokens += len(new_tokens)
        self.stats.batch_sizes[len(scheduler_output.scheduled_requests)] += 1
        return self.output_processor.make_outputs()

    def _count_computed_prompt_tokens(self, scheduler_output) -> None:
        for request, num in zip(
            scheduler_output.scheduled_requests, scheduler_output.num_scheduled_tokens
        ):
            start = min(request.num_computed_tokens, request.num_prompt_tokens)
            end = min(request.num_computed_tokens + num, request.num_prompt_tokens)
            self.stats.num_computed_prompt_tokens += end - start

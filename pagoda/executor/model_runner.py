"""SchedulerOutput -> input tensors -> one forward for the whole batch -> sampler.

The runner takes and returns plain data (pagoda/step_data.py) and keeps its own record of
the running requests (input_batch.py); it never sees the engine's objects.

Batch layout: the scheduled tokens of every request, concatenated in schedule order.

    tokens:   [ req0: n0 tokens | req1: n1 tokens | ... ]       (num_tokens,)
    sampled:  the last token of each request whose step reaches its end (computed + n ==
              num_tokens); a request stopping inside its prompt (a partial prefill chunk)
              samples nothing.
    pooled:   a pooling (embedding) request samples nothing: its rows go to pooling.py,
              which returns its vector in the step that computes its prompt's end.
    adapters: with --enable-lora, the forward runs under the step's row -> adapter mapping
              (executor/lora/: each request's rows get its LoRA adapter's deltas).

KV tiers (--kv-offload-memory / --kv-offload-dir): the runner holds the KVOffloadWorker
(executor/kv_offload/) over its caches, runs each step's kv_saves, kv_loads and kv_drops
before the forward (saves first), and returns the failed loads, the tiers' counters and the
keys they evicted; the engine asks for the disk tier's keys at start and flushes the pool's
cached blocks to disk at shutdown. Entries carry `kv_offload_fingerprint`: never reused
across another model file, dtype, KV dtype, block size or layout.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagoda.config import CacheConfig
from pagoda.executor.attention.cpu_backend import select_backend
from pagoda.executor.attention.kv_quant import QuantizedKVCache, check_kv_cache_dtype
from pagoda.executor.forward_context import forward_context
from pagoda.executor.input_batch import InputBatch
from pagoda.executor.kernels.ops import DEQUANTIZE_FROM_ROWS
from pagoda.executor.kv_cache_allocation import allocate_kv_caches, kv_bytes_per_token
from pagoda.executor.kv_cache_layout import kv_cache_groups
from pagoda.executor.kv_offload import KVOffloadWorker
from pagoda.executor.lora.manager import LoRAManager
from pagoda.executor.lora.step import lora_step
from pagoda.executor.pooling import pool_chunks
from pagoda.executor.sampler import Sampler
from pagoda.executor.spec_decode.decoder import SpecDecoder
from pagoda.executor.spec_decode.verify import one_row_per_token, verify_proposals
from pagoda.executor.step_sampling import (
    SeededGenerators,
    prompt_logprobs,
    sample_last_positions,
)
from pagoda.executor.whole_stack_decode import WholeStackDecode
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        cache_config: CacheConfig,
        eos_token_ids: list[int],
        batch_invariant: bool = False,
        whole_stack_decode: bool = True,
    ) -> None:
        """`batch_invariant`: the model was made so (executor/batch_invariant.py); the
        attention backends are then the kernel's batch-invariant one, and decode steps run
        the eager forward. `whole_stack_decode`: decode steps may take the whole-stack C
        step where it covers the model (off for a tensor-parallel rank: its layers need
        collectives between them)."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.whole_stack = (WholeStackDecode.for_model(model)
                            if whole_stack_decode and not batch_invariant else None)
        """The step executors, tried in this order: this (decode steps it covers), else
        torch.compile's graph once runner_builder.compile_model ran (which drops this),
        else the eager forward."""
        self.compiled = False
        self.last_step_executor = "eager"
        """Which executor ran the last forward: "whole-stack", "compiled" or "eager"."""
        self.cache_config = cache_config
        self.eos_token_ids = eos_token_ids
        hf_config = model.config
        self.vocab_size = hf_config.vocab_size
        self.num_layers = hf_config.num_hidden_layers
        first_attention = model.attention_layers()[0]
        # This process's heads (a tensor-parallel rank holds a share of them)
        self.num_heads = first_attention.num_heads
        self.num_kv_heads = first_attention.num_kv_heads
        self.head_dim = first_attention.head_dim
        self.kv_planes = 1 if first_attention.values_in_keys else 2
        """Planes of each layer's cache: keys and values, or keys only (values are keys)."""
        self.block_size = cache_config.block_size
        self.kv_cache_dtype = cache_config.kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype, dtype, device)
        self.set_kv_cache_groups()
        self.sampler = Sampler()
        self.generators = SeededGenerators(device)
        """Seeded requests' generators, kept across preemption until the request finishes."""
        self.kv_caches: list[torch.Tensor | QuantizedKVCache] = []
        self.num_blocks = 0
        """Blocks of the smallest group (what a scratch forward may use)."""
        self.num_blocks_per_group: list[int] = []
        self.spec_decoder: SpecDecoder | None = None
        """Proposes tokens for the next step (speculative decoding); set by the builder."""
        self.lora: LoRAManager | None = None
        """LoRA adapters (--enable-lora): loads them and maps each step's rows to theirs;
        set by the builder (runner_builder.attach_lora)."""
        self.kv_offload: KVOffloadWorker | None = None
        """The KV tiers below the cache (runner_builder.attach_kv_offload); None: off."""

    # ---- KV tiers --------------------------------------------------------------------------

    def kv_offload_known_keys(self) -> list[int]:
        """Prefix keys the tiers hold now (at start: the disk tier's entries of this model)."""
        return self.kv_offload.known_keys() if self.kv_offload is not None else []

    def kv_offload_flush(self, items: list[tuple[int, int]]) -> None:
        """Shutdown: (hash, block id) of the cache's prefix blocks -> the disk tier."""
        if self.kv_offload is not None:
            self.kv_offload.flush(items)

    def _run_kv_ops(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """The step's copies between the cache and the tiers, before its forward: saves
        first (a block saved may be loaded into, or overwritten, in this very step)."""
        worker = self.kv_offload
        if scheduler_output.kv_saves:
            worker.save(scheduler_output.kv_saves)
        if scheduler_output.kv_loads:
            output.kv_load_failures = worker.load(scheduler_output.kv_loads)
        if scheduler_output.kv_drops:
            worker.drop(scheduler_output.kv_drops)
        output.kv_offload_stats = worker.take_stats()
        output.kv_offload_dropped = worker.take_dropped()

    # ---- KV cache --------------------------------------------------------------------------

    def set_kv_cache_groups(self, max_model_len: int | None = None) -> None:
        """Group the layers by window (kv_cache_layout.py: one group unless some layers
        slide), with a backend (it knows its group's number of blocks) and a block table per
        group. A window no shorter than max_model_len never drops a block: such layers stay
        in the full-attention group (and prefix caching stays on). Before the cache exists."""
        model = self.model
        self.kv_cache_windows, self.layer_kv_groups = kv_cache_groups(
            [layer.keys_window or model.sliding_window or None
             for layer in model.attention_layers()], max_model_len)
        self.backends = [select_backend(
            self.block_size, self.device, self.dtype, self.num_heads, self.num_kv_heads,
            self.head_dim, model.sliding_window, self.kv_cache_dtype, self.batch_invariant,
            values_in_keys=self.kv_planes == 1,
        ) for _ in self.kv_cache_windows]
        self.backend = self.backends[0]
        self.input_batch = InputBatch(num_kv_cache_groups=self.num_kv_cache_groups)

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.kv_cache_windows)

    def same_table_every_group(self, block_table: np.ndarray) -> list[np.ndarray]:
        """Block tables for a scratch forward: the same (num_seqs, max_blocks) table in every
        KV-cache group (its first blocks exist in every group's pool)."""
        return [block_table] * self.num_kv_cache_groups

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers and KV heads; an 8-bit cache counts its
        codes and its scales (kv_quant.py)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                                  self.kv_cache_dtype, self.kv_planes)

    def initialize_kv_cache(self, per_group: list[int]) -> None:
        """Allocate each layer's paged cache, sized by its KV-cache group's number of blocks
        (`per_group`: one count per group), and bind it to the layer."""
        assert len(per_group) == self.num_kv_cache_groups, (per_group, self.kv_cache_windows)
        self.kv_caches = [None] * len(self.layer_kv_groups)
        for group, (backend, count) in enumerate(zip(self.backends, per_group)):
            layer_ids = [i for i, g in enumerate(self.layer_kv_groups) if g == group]
            shape = backend.kv_cache_shape(count, self.num_kv_heads, self.head_dim,
                                           self.kv_planes)
            caches = allocate_kv_caches(shape, len(layer_ids), self.dtype, self.device,
                                        self.kv_cache_dtype)
            for i, kv_cache in zip(layer_ids, caches):
                self.kv_caches[i] = kv_cache
        for layer, kv_cache, group in zip(self.model.attention_layers(), self.kv_caches,
                                          self.layer_kv_groups):
            layer.kv_cache = kv_cache
            layer.backend = self.backends[group]
            layer.kv_cache_group = group
        self.num_blocks_per_group = list(per_group)
        self.num_blocks = min(per_group)

    # ---- one step --------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        block_tables: list[np.ndarray],
    ) -> torch.Tensor:
        """block_tables: one (num_seqs, max_blocks) table per KV-cache group. The forward
        context holds one metadata per group (attention layers pick theirs by index)."""
        metadata = [backend.build_metadata(num_computed, num_scheduled, tables)
                    for backend, tables in zip(self.backends, block_tables, strict=True)]
        input_tensor = torch.from_numpy(input_ids).to(self.device)
        with forward_context(metadata):
            if self.whole_stack is not None:
                hidden = self.whole_stack.forward(input_tensor, metadata[0].positions)
                if hidden is not None:
                    self.last_step_executor = "whole-stack"
                    return hidden
            self.last_step_executor = "compiled" if self.compiled else "eager"
            return self.model(input_tensor, metadata[0].positions)

    def describe_step_executors(self) -> str:
        """One line for the start-up log: which executor runs which steps. After the KV
        cache is allocated (the whole-stack step plans over it)."""
        if self.compiled:
            return "every step through torch.compile's graph"
        if self.whole_stack is not None and self.whole_stack.plan() is not None:
            return (f"decode steps of fewer than {DEQUANTIZE_FROM_ROWS} tokens as one C call "
                    f"(the whole-stack step, csrc/decoder_f32.c); other steps eager")
        return "every step eager (op by op)"

    @torch.inference_mode()
    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of each prompt, all prompts in one forward.

        Uses the cache's first blocks as scratch (call it only while no request runs).
        Returns one float32 (len(prompt), vocab) tensor per prompt."""
        lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
        blocks_per_prompt = -(-lengths // self.block_size)
        if blocks_per_prompt.sum() > self.num_blocks:
            raise ValueError(
                f"prompts need {blocks_per_prompt.sum()} KV blocks, the cache has {self.num_blocks}"
            )
        block_tables = np.zeros((len(prompts), int(blocks_per_prompt.max())), dtype=np.int64)
        first_block = np.concatenate([[0], np.cumsum(blocks_per_prompt)[:-1]])
        for row, (first, count) in enumerate(zip(first_block, blocks_per_prompt)):
            block_tables[row, :count] = np.arange(first, first + count)
        input_ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        hidden = self._forward(input_ids, np.zeros_like(lengths), lengths,
                               self.same_table_every_group(block_tables))
        return list(self.model.compute_logits(hidden).split(lengths.tolist()))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the batch record up to date: drop finished and preempted requests (a
        preempted one returns as new), add new ones, extend block tables."""
        for request_id in scheduler_output.finished_request_ids:
            self.input_batch.remove(request_id)
            self.generators.forget(request_id)
            if self.spec_decoder is not None:
                self.spec_decoder.remove(request_id)
        for request_id in scheduler_output.preempted_request_ids:
            self.input_batch.remove(request_id)
            if self.spec_decoder is not None:
                self.spec_decoder.remove(request_id, preempted=True)
        for new in scheduler_output.new_requests:
            self.input_batch.remove(new.request_id)  # dropped when preempted: a no-op then
            self.input_batch.add(new)
        for request_id, block_ids in scheduler_output.new_block_ids.items():
            self.input_batch.append_blocks(request_id, block_ids)
        if self.lora is not None:
            self.lora.remove(scheduler_output.removed_lora_ids)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        request_ids = scheduler_output.request_ids
        output = ModelRunnerOutput(request_ids=list(request_ids),
                                   sampled_token_ids=[None] * len(request_ids))
        if self.kv_offload is not None:
            self._run_kv_ops(scheduler_output, output)
        if not request_ids:
            return output
        batch = self.input_batch
        states = [batch.requests[request_id] for request_id in request_ids]
        rows = np.fromiter((state.row for state in states), dtype=np.int64, count=len(states))
        num_scheduled = np.asarray(scheduler_output.num_scheduled_tokens, dtype=np.int64)
        num_computed = batch.num_computed[rows]  # (a copy: fancy indexing)
        # Token i of request r sits at position num_computed[r] + i of its row.
        query_start = np.cumsum(num_scheduled) - num_scheduled
        positions = np.arange(int(num_scheduled.sum())) + np.repeat(num_computed - query_start,
                                                                    num_scheduled)
        # Proposals to verify sit after each request's tokens (not counted in num_tokens).
        spec = scheduler_output.spec_token_ids
        num_spec = np.array([batch.write_proposals(state, spec.get(state.request_id, ()))
                             for state in states], dtype=np.int64) if spec else 0
        input_ids = batch.token_ids[np.repeat(rows, num_scheduled), positions]
        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = [table[rows, :max_blocks] for table in batch.block_tables]
        reaches_end = (num_computed + num_scheduled) == batch.num_tokens[rows] + num_spec
        pooling = [state.pooling_params is not None for state in states]
        if any(pooling):
            reaches_end &= ~np.asarray(pooling)  # (pooling requests sample nothing)
        batch.num_computed[rows] = num_computed + num_scheduled

        decode_shaped = num_scheduled == 1 + num_spec  # a decode or a verification
        started = time.perf_counter()
        adapters = None  # which rows run which LoRA adapter (None: all the base model)
        if self.lora is not None:
            adapters = self.lora.step_of(states, num_scheduled, batch, output.failed)
        with lora_step(adapters):
            if spec:  # verifications attend one token a row: a decode-shaped step
                hidden = self._forward(input_ids, *one_row_per_token(
                    num_computed, num_scheduled, block_tables, decode_shaped))
            else:
                hidden = self._forward(input_ids, num_computed, num_scheduled, block_tables)
        output.step_executor = self.last_step_executor

        query_end = query_start + num_scheduled
        if any(pooling):
            pool_chunks(states, num_computed, num_scheduled, query_start, hidden, output)
        prompt_logprobs(self.model, self.device, states, num_computed, num_scheduled, query_end,
                        hidden, output)
        sample_rows = np.nonzero(reaches_end)[0]
        if len(sample_rows) == 0:
            return output
        if spec:
            verify_proposals(self, states, sample_rows, query_end, hidden, scheduler_output,
                             output)
        else:
            sample_last_positions(self, states, sample_rows, query_end, hidden, scheduler_output,
                                  output)
        if self.spec_decoder is not None:
            self._propose(states, sample_rows, num_scheduled, decode_shaped, started, output)
        return output

    def _propose(self, states: list, sample_rows: np.ndarray, num_scheduled: np.ndarray,
                 decode_shaped: np.ndarray, started: float, output: ModelRunnerOutput) -> None:
        """Speculative decoding, after sampling: time a decode-shaped step (the proposer
        adapts to it), then propose the next step's tokens of each request that sampled."""
        if decode_shaped.all():  # (the sampling's host sync has waited for the device)
            self.spec_decoder.observe_step(int(num_scheduled.sum()),
                                           time.perf_counter() - started)
        output.spec_token_ids = self.spec_decoder.propose(
            [states[i] for i in sample_rows if states[i].request_id not in output.failed],
            self.input_batch)


"""Steps 2-4 of start-up (pagoda/engine/loop/builder.py): an EngineConfig -> a ModelRunner with its
model loaded and its KV cache allocated. Runs in the engine's process, or in each
tensor-parallel worker (pagoda/executor/parallel/) for its share of the model.

The start-up work on a runner lives here (the runner itself only runs steps): attaching
LoRA and the KV tiers' worker, and torch.compile with its warm-up. The cache's sizing is
kv_cache_allocation.py's."""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.config import CacheConfig, EngineConfig
from pagoda.executor.batch_invariant import make_batch_invariant
from pagoda.executor.kernels.arithmetic import (
    resolve_amx_rows,
    resolve_decode_activations,
    resolve_prefill_dtype,
    set_amx_rows,
)
from pagoda.executor.kernels.cpu_info import describe_run, run_info
from pagoda.executor.kv_cache_allocation import determine_kv_cache_blocks
from pagoda.executor.kv_cache_layout import kv_capacity_tokens
from pagoda.executor.kv_offload import KVOffloadConfig, KVOffloadWorker
from pagoda.executor.kv_offload.fingerprint import kv_offload_fingerprint
from pagoda.executor.layers.moe import routed_expert_modules
from pagoda.executor.layers.packed_linear import body_linears, set_arithmetic
from pagoda.executor.layers.quantization import QuantizedLinear
from pagoda.executor.layers.rope_scaling import scaled_context_length
from pagoda.executor.layers.rotary import rope_parameters
from pagoda.executor.loader.heap import release_freed_memory
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import (
    load_model,
    open_checkpoint,
    resolve_device,
    resolve_dtype,
    set_cpu_threads,
    weight_formats,
)
from pagoda.executor.loader.tokenizer import eos_token_ids, load_tokenizer
from pagoda.executor.lora.manager import LoRAManager
from pagoda.executor.lora.model_lora import ModelLoRA
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.parallel.communication import TensorParallelGroup
from pagoda.executor.parallel.sharding import shard_model
from pagoda.executor.spec_decode.builder import build_spec_decoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltRunner:
    """What the engine needs to know of a runner it did not build itself (a worker's)."""

    max_model_len: int
    num_blocks: list[int]
    """KV blocks of each KV-cache group."""
    kv_cache_windows: list[int | None]
    run_info: dict = field(default_factory=dict)
    """cpu_info.run_info: the device, CPU, dtypes and kernels this runner multiplies with."""
    kv_block_bytes: int = 0
    """What one KV block takes in the KV tiers (0: no tiers)."""


def build_runner(
    config: EngineConfig,
    group: TensorParallelGroup | None = None,
    checkpoint=None,
    tokenizer=None,
) -> tuple[ModelRunner, BuiltRunner]:
    """Steps 2-4 of the module docstring: the model loaded (and cut to `group.rank`'s share
    under tensor parallelism), its runner with the KV cache allocated, compiled if asked.

    Every rank of a tensor-parallel group runs this, in step: the KV cache gets rank 0's
    number of blocks on every rank (broadcast), and the compile warm-up's forwards meet in
    their collectives. `checkpoint` / `tokenizer`: already opened ones, else opened here."""
    files = resolve_model_files(config.model.model)
    checkpoint = checkpoint or open_checkpoint(files)
    hf_config = checkpoint.hf_config
    device, dtype = _device_and_dtype(config, group)
    max_model_len = _requested_model_len(config, hf_config)
    torch.manual_seed(config.model.seed)
    model = load_model(
        checkpoint, dtype, device, max_position=max_model_len,
        quantization=config.model.quantization,
    )
    if group is not None:
        shard_model(model, group)
        release_freed_memory()
    if config.model.deterministic:
        make_batch_invariant(model, dtype, device)
    arithmetic = _choose_arithmetic(model, config, device)
    tokenizer = tokenizer or load_tokenizer(resolve_model_files(config.model.tokenizer)
                                            if config.model.tokenizer else files)
    eos_ids = eos_token_ids(files, tokenizer, hf_config)
    runner = ModelRunner(model, device, dtype, config.cache, eos_ids,
                         batch_invariant=config.model.deterministic,
                         whole_stack_decode=group is None)
    if config.lora.enable_lora:  # hooks on this process's layers (a rank's share under TP)
        attach_lora(runner, LoRAManager(ModelLoRA(model, config.lora.max_loras, device,
                                                 row_wise=config.model.deterministic),
                                       config.lora, hf_config))
    if device.type == "cpu":
        logger.info(describe_run(dtype, weight_formats(model), runner.backend.name, arithmetic)
                    + (", batch-invariant (--deterministic)" if runner.batch_invariant else ""))
    info = run_info(dtype, weight_formats(model), runner.backend.name, arithmetic, device.type)
    max_model_len, num_blocks = _size_kv_cache(config, runner, max_model_len, group)
    runner.initialize_kv_cache(num_blocks)  # one count per KV-cache group
    if config.cache.kv_offload_enabled:  # (tensor parallelism is refused with the tiers)
        attach_kv_offload(runner, config.cache, files.path)
    if config.speculative is not None:
        runner.spec_decoder = build_spec_decoder(config, runner, tokenizer, max_model_len)
    if config.model.compile:
        start = time.perf_counter()
        sizes = compile_model(runner)
        logger.info("compiled the model for steps of %s tokens in %.0f s",
                    ", ".join(map(str, sizes)), time.perf_counter() - start)
    logger.info("step executors: %s", runner.describe_step_executors())
    torch.manual_seed(config.model.seed)  # every rank samples from the same generator state
    return runner, BuiltRunner(max_model_len, list(num_blocks), list(runner.kv_cache_windows),
                               info, runner.kv_offload.record_bytes if runner.kv_offload else 0)


def _device_and_dtype(config: EngineConfig,
                      group: TensorParallelGroup | None) -> tuple[torch.device, torch.dtype]:
    """This process's device (a tensor-parallel rank's own GPU) and dtype; on CPU, the
    threads set for this process's share of the cores."""
    device = resolve_device(config.device)
    if group is not None and device.type == "cuda":
        device = torch.device("cuda", group.device_index)
    dtype = resolve_dtype(config.model.dtype, device)
    if device.type == "cpu":
        world_size = 1 if group is None else group.world_size
        logger.info("%d CPU threads", set_cpu_threads(world_size))
    return device, dtype


def _requested_model_len(config: EngineConfig, hf_config) -> int:
    """max_model_len as asked, else the model's context length (YaRN and dynamic NTK extend
    it past max_position_embeddings: rope_scaling.py); ValueError past that length. The KV
    cache's capacity may lower it later (_size_kv_cache)."""
    context_len = scaled_context_length(hf_config, rope_parameters(hf_config))
    max_model_len = config.model.max_model_len or context_len
    if max_model_len > context_len:
        raise ValueError(
            f"max_model_len {max_model_len} is longer than the model's context length "
            f"{context_len}"
        )
    return max_model_len


def _choose_arithmetic(model: torch.nn.Module, config: EngineConfig,
                       device: torch.device) -> tuple[torch.dtype, int, dict[str, int]] | None:
    """What the model's packed linears multiply in (set on them): the large batches' dtype,
    the small batches' activation_parts and the formats AMX tiles take from some row count
    on; None where it has none (or runs off the CPU). kernels/arithmetic.py decides,
    measuring this CPU where a setting is auto."""
    if device.type != "cpu" or not set_arithmetic(model, torch.float32):
        return None
    if config.model.deterministic:
        return torch.float32, 0, {}
    large_batch_dtype = resolve_prefill_dtype(config.model.prefill_dtype, config.model.dtype)
    weights = _one_token_weights(model)
    parts = resolve_decode_activations(config.model.decode_activations, config.model.dtype,
                                       weights)
    set_arithmetic(model, large_batch_dtype, parts)
    amx_rows = resolve_amx_rows(weights, parts)
    set_amx_rows(amx_rows)
    release_freed_memory()  # the timed products' operands, which free() keeps in the heap
    return large_batch_dtype, parts, amx_rows


def _one_token_weights(model: torch.nn.Module) -> list:
    """The packed weights a decode token reads, the ones the arithmetic is timed on: every
    body linear's, but of each sparse MoE block only its first top_k experts' (a token
    reads top_k of them; timing all of them would time a read of the whole file, where
    every arithmetic waits on memory alike)."""
    unread = {id(module) for block, index, module in routed_expert_modules(model)
              if index >= block.top_k}
    return [segment for linear in body_linears(model) if id(linear) not in unread
            for segment in linear.segments]


def _size_kv_cache(
    config: EngineConfig, runner: ModelRunner, max_model_len: int,
    group: TensorParallelGroup | None = None,
) -> tuple[int, list[int]]:
    """(max_model_len, number of KV blocks of each KV-cache group): the blocks that fit, and
    max_model_len lowered to their capacity if the user did not set it. Under tensor
    parallelism rank 0's count holds for every rank (each holds its share of the heads)."""
    num_blocks = determine_kv_cache_blocks(runner, max_model_len, config.scheduler)
    if group is not None:
        num_blocks = group.broadcast_object(num_blocks)
    capacity = kv_capacity_tokens(runner.kv_cache_windows, num_blocks, config.cache.block_size,
                                  config.scheduler.max_num_batched_tokens, max_model_len)
    if capacity < max_model_len:
        if config.model.max_model_len is not None:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"{max_model_len}; give it more memory or lower max_model_len"
            )
        logger.warning("max_model_len lowered from %d to the KV capacity %d", max_model_len, capacity)
        max_model_len = capacity
    if not config.scheduler.enable_chunked_prefill and (
        config.scheduler.max_num_batched_tokens < max_model_len
    ):
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens "
            f"({config.scheduler.max_num_batched_tokens}) must be at least max_model_len "
            f"({max_model_len}), or long prompts could never be scheduled"
        )
    return max_model_len, num_blocks


# ---- what start-up attaches to a runner ----------------------------------------------------


def attach_lora(runner: ModelRunner, manager: LoRAManager) -> None:
    """LoRA adapters (--enable-lora) on the runner, and on its whole-stack C step if any."""
    runner.lora = manager
    if runner.whole_stack is not None:
        runner.whole_stack.attach_lora(manager.model_lora)


def attach_kv_offload(runner: ModelRunner, cache_config: CacheConfig, model_path: str,
                      tp_rank: int = 0, tp_size: int = 1) -> None:
    """Create the KV tiers' worker over the runner's allocated cache (after
    initialize_kv_cache). ValueError for a model with sliding-window layers (their blocks
    are freed out of the window and carry no prefix hashes)."""
    if runner.kv_cache_windows != [None]:
        raise ValueError("the KV tiers (kv_offload_memory, kv_offload_dir) need a model "
                         "whose layers all attend to the whole sequence; this one has "
                         "sliding-window layers")
    config = KVOffloadConfig(
        cache_config.kv_offload_memory, cache_config.kv_offload_dir,
        cache_config.kv_offload_disk_bytes if cache_config.kv_offload_dir else 0)
    fingerprint = kv_offload_fingerprint(
        model_path, runner.dtype, runner.kv_cache_dtype, runner.block_size, runner.num_layers,
        runner.num_kv_heads, runner.head_dim, tp_rank, tp_size)
    runner.kv_offload = KVOffloadWorker(runner.kv_caches, config, fingerprint)


# ---- torch.compile -------------------------------------------------------------------------


def compile_model(runner: ModelRunner) -> list[int]:
    """torch.compile the decoder stack (`model.model`; attention stays one opaque op, see
    pagoda/executor/attention/layer.py), then warm it up: run the step shapes the engine
    will meet, so their graphs are compiled now and not during the first requests.
    Dynamo specialises one-token steps; quantized layers branch at `dense_from_rows`,
    so that many tokens is one more shape. Needs the KV cache (its first blocks are
    scratch). Returns the token counts run."""
    model = runner.model
    stack = model.model
    runner.whole_stack, runner.compiled = None, True  # the compiled graph runs every step
    # Dynamo keeps compiled graphs, and the guards that pick one, per code object. The
    # stack's forward gets a code object of its own, so that its graphs are only ever
    # offered to this model; then guards on the modules' attributes can go (nothing the
    # graph reads from them changes after loading: weights, rotary tables and layer ids
    # are fixed, the KV cache and step metadata sit behind the opaque attention op).
    # Checking those thousands of guards every step cost a sizeable share of a
    # one-sequence step (measured in BENCHMARKS.md).
    stack.forward = torch.compile(
        _private_forward(stack), dynamic=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )
    branch_sizes = {m.dense_from_rows for m in model.modules()
                    if isinstance(m, QuantizedLinear) and m.dense_from_rows}
    warm_up_sizes = sorted({1, 2, 16} | branch_sizes)
    with torch.inference_mode():
        for num_tokens in warm_up_sizes:
            blocks = runner.same_table_every_group(
                np.zeros((1, -(-num_tokens // runner.block_size)), dtype=np.int64))
            runner._forward(np.zeros(num_tokens, dtype=np.int64), np.array([0]),
                            np.array([num_tokens]), blocks)
    return warm_up_sizes


def _private_forward(module: torch.nn.Module):
    """`module`'s forward as a function with a code object of its own (a nested function's
    code is shared by every call of its maker; the replace() copy is new): graphs Dynamo
    compiles for it belong to this module alone."""
    class_forward = type(module).forward

    def forward(*args):
        return class_forward(module, *args)

    code = forward.__code__.replace(co_name=f"forward_of_{type(module).__name__}_{id(module):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)

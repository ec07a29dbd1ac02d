"""Start-up: an EngineConfig -> a ready LLMEngine (model loaded, KV cache sized, scheduler up).

The order matters for the errors a user sees and for memory:
  1. resolve and open the checkpoint (a bad path or an unsupported architecture fails
     before anything slow), load the tokenizer;
  2. pick device and dtype, set the CPU threads, settle max_model_len against the model;
  3. load the weights (quantized layer by layer where asked), build the model runner;
  4. size the KV cache from what memory is left, lower max_model_len to it if it was not
     given (refuse if it was), allocate the cache, compile if asked;
  5. the engine: scheduler + block manager + request lifecycle around the runner.
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.config import EngineConfig
from pagoda.engine.grammar import GrammarCompiler
from pagoda.engine.llm_engine import LLMEngine
from pagoda.executor.kernels.cpu_info import describe_run
from pagoda.executor.kv_cache_layout import kv_capacity_tokens
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
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.models.registry import resolve_model_class
from pagoda.executor.spec_decode.builder import build_spec_decoder

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig | None = None) -> LLMEngine:
    """Load the model named by `config` and return the engine around it. Raises ValueError
    (ModelLoadError included) for a bad path, model or setting."""
    config = config or EngineConfig()
    files = resolve_model_files(config.model.model)
    tokenizer_files = resolve_model_files(config.model.tokenizer) if config.model.tokenizer else files
    checkpoint = open_checkpoint(files)  # before the tokenizer: clearer errors on bad files
    hf_config = checkpoint.hf_config
    resolve_model_class(hf_config)  # an unsupported architecture fails here
    tokenizer = load_tokenizer(tokenizer_files)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if device.type == "cpu":
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
        checkpoint, dtype, device, max_position=max_model_len,
        quantization=config.model.quantization,
    )
    eos_ids = eos_token_ids(files, tokenizer, hf_config)
    runner = ModelRunner(model, device, dtype, config.cache, eos_ids)
    if device.type == "cpu":
        logger.info(describe_run(dtype, weight_formats(model), runner.backend.name))
    max_model_len, num_blocks = _size_kv_cache(config, runner, max_model_len)
    runner.initialize_kv_cache(num_blocks)  # one count per KV-cache group
    if config.speculative is not None:
        runner.spec_decoder = build_spec_decoder(config, runner, tokenizer, max_model_len)
    if config.model.compile:
        start = time.perf_counter()
        sizes = runner.compile_model()
        logger.info("compiled the model for steps of %s tokens in %.0f s",
                    ", ".join(map(str, sizes)), time.perf_counter() - start)
    logger.info(
        "KV cache: %s blocks of %d tokens = %d tokens; max_model_len %d",
        " + ".join(map(str, num_blocks)), config.cache.block_size,
        sum(num_blocks) * config.cache.block_size, max_model_len,
    )
    vocab_size = int(hf_config.vocab_size)
    grammar_compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    grammar_compiler.warm_up()
    return LLMEngine(
        config, runner, tokenizer, eos_ids, max_model_len=max_model_len,
        num_blocks=num_blocks[0] if len(num_blocks) == 1 else num_blocks,
        vocab_size=vocab_size, model_files=files, hf_config=hf_config,
        grammar_compiler=grammar_compiler, kv_cache_windows=runner.kv_cache_windows,
    )


def _size_kv_cache(
    config: EngineConfig, runner: ModelRunner, max_model_len: int
) -> tuple[int, list[int]]:
    """(max_model_len, number of KV blocks of each KV-cache group): the blocks that fit, and
    max_model_len lowered to their capacity if the user did not set it."""
    num_blocks = runner.determine_kv_cache_blocks(max_model_len, config.scheduler)
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

"""Start-up: an EngineConfig -> a ready LLMEngine (model loaded, KV cache sized, scheduler up).

The order matters for the errors a user sees and for memory:
  1. resolve and open the checkpoint (a bad path or an unsupported architecture fails
     before anything slow), load the tokenizer;
  2-4. the model runner (pagoda/executor/runner_builder.py): device, dtype, threads,
     weights, KV cache, compile; in this process, or in tensor-parallel workers;
  5. the engine: scheduler + block manager + request lifecycle around the runner;
  6. everything built so far moved out of the garbage collector's sight (gc.freeze): the
     model's modules, the tokenizer's tables and the grammar compiler's are never garbage
     while the engine lives, and a full collection scanning them costs a decode step
     several milliseconds (vLLM freezes its start-up heap too). Unfrozen and collected
     first: an engine dropped since the last build (frozen then) is collected now.
"""

from __future__ import annotations

import gc
import logging

from pagoda.config import EngineConfig
from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.loop.llm_engine import LLMEngine
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import open_checkpoint
from pagoda.executor.loader.pooling_files import model_pooling
from pagoda.executor.loader.tokenizer import eos_token_ids, load_tokenizer
from pagoda.executor.models.registry import resolve_model_class
from pagoda.executor.runner_builder import build_runner

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig | None = None) -> LLMEngine:
    """Load the model named by `config` and return the engine around it. Raises ValueError
    (ModelLoadError included) for a bad path, model or setting.

    With tensor_parallel_size > 1 the model runs in that many worker processes
    (pagoda/executor/parallel/), each building its share with `build_runner`; this process
    keeps the engine and drives them."""
    config = config or EngineConfig()
    files = resolve_model_files(config.model.model)
    checkpoint = open_checkpoint(files)  # before the tokenizer: clearer errors on bad files
    hf_config = checkpoint.hf_config
    resolve_model_class(hf_config)  # an unsupported architecture fails here
    pooling = model_pooling(config.embedding, files, hf_config,
                            (checkpoint.architecture, checkpoint.pooling_type)
                            if files.format == "gguf" else None)
    tokenizer = load_tokenizer(resolve_model_files(config.model.tokenizer)
                               if config.model.tokenizer else files)
    eos_ids = eos_token_ids(files, tokenizer, hf_config)
    if config.parallel.tensor_parallel_size > 1:
        from pagoda.executor.parallel.tp_runner import start_tensor_parallel_runner

        runner, built = start_tensor_parallel_runner(config)
    else:
        runner, built = build_runner(config, checkpoint=checkpoint, tokenizer=tokenizer)
    logger.info(
        "KV cache: %s blocks of %d tokens = %d tokens; max_model_len %d",
        " + ".join(map(str, built.num_blocks)), config.cache.block_size,
        sum(built.num_blocks) * config.cache.block_size, built.max_model_len,
    )
    vocab_size = int(hf_config.vocab_size)
    grammar_compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)  # its trie: on first use
    engine = LLMEngine(
        config, runner, tokenizer, eos_ids, max_model_len=built.max_model_len,
        num_blocks=built.num_blocks,
        vocab_size=vocab_size, model_files=files, hf_config=hf_config,
        grammar_compiler=grammar_compiler, kv_cache_windows=built.kv_cache_windows,
        run_info=built.run_info, model_pooling=pooling, kv_block_bytes=built.kv_block_bytes,
    )
    logger.info("embeddings: %s pooling (from %s), %s", pooling.pooling, pooling.source,
                "normalised" if pooling.normalize else "not normalised")
    collect_and_freeze()
    return engine


def collect_and_freeze() -> None:
    """Collect every unreachable cycle, frozen ones included (engines dropped since the last
    freeze), then freeze what is left out of the collector's sight (step 6 above)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()

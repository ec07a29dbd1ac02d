"""`compile=True`: the torch.compile'd decoder stack (attention as the opaque
`pagoda::attention` op, Pagoda's quantized matmul as `pagoda::gemm_q`) generates what the
eager model does."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.executor.layers.quantization import QuantizedLinear
from pagoda.executor.loader.model_files import bundled_model_path
from tests.executor.test_cpu_kernels import needs_bf16_kernels
from tests.executor.tiny_checkpoints import build_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 7, 11, 3], [8, 1, 4], [12, 6, 10, 3, 3, 9, 1, 2, 5, 7, 4, 8, 6, 2, 9, 11, 1, 3]]


def greedy_run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens, with the logprob of every prompt and output token."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    runs = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        chosen = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        chosen += [position[token].logprob
                   for token, position in zip(completion.token_ids, completion.logprobs)]
        runs.append((completion.token_ids, chosen))
    return runs


# qwen3: q/k norms before the rotary; qwen3-moe: MoE blocks as the opaque `pagoda::moe` op
# (a graph broken inside one layer's routing was reused for the next layer's dense MLP)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
def test_compiled_model_generates_what_eager_does(arch, tmp_path) -> None:
    build_checkpoint(arch, str(tmp_path))
    kwargs = {"model": str(tmp_path), "tokenizer": bundled_model_path(), "dtype": "float32",
              "kv_cache_memory": 1 << 20, "max_model_len": 64, "block_size": 4}
    eager = LLM(**kwargs)
    compiled = LLM(**kwargs, compile=True)
    # the decoder stack's forward is compiled (a code object of its own per model: this test,
    # run for two architectures in one process, fails if one model's graphs reach the other)
    assert hasattr(compiled.engine.runner.model.model.forward, "_torchdynamo_orig_callable")
    assert not hasattr(eager.engine.runner.model.model.forward, "_torchdynamo_orig_callable")

    # One prompt (one-token decode steps), then three at once (3-token decode steps,
    # prompts of different lengths): the graphs compiled at start, attention through the op.
    for prompts in ([PROMPTS[0]], PROMPTS):
        for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(
            greedy_run(compiled, prompts), greedy_run(eager, prompts)
        ):
            assert tokens == eager_tokens
            torch.testing.assert_close(logprobs, eager_logprobs, rtol=1e-4, atol=1e-4)


@needs_bf16_kernels
def test_compiled_int4_model_runs_pagodas_kernels_as_eager_does(tmp_path) -> None:
    """bf16 + int4: the quantized matmul and the int8 head go through the `pagoda::gemm_q`
    custom op inside the compiled graph, and give what the eager calls give (bf16: fused
    pointwise ops round differently, hence the looser tolerance)."""
    build_checkpoint("llama", str(tmp_path))
    kwargs = {"model": str(tmp_path), "tokenizer": bundled_model_path(), "dtype": "bfloat16",
              "quantization": "int4", "kv_cache_memory": 1 << 20, "max_model_len": 64,
              "block_size": 4}
    eager = LLM(**kwargs)
    compiled = LLM(**kwargs, compile=True)
    layers = [m for m in compiled.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.kernel for m in layers} == {"pagoda"}
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(
        greedy_run(compiled, PROMPTS), greedy_run(eager, PROMPTS)
    ):
        assert tokens == eager_tokens
        torch.testing.assert_close(logprobs, eager_logprobs, rtol=5e-2, atol=5e-2)


def test_compiled_packed_gguf_model_generates_what_eager_does(tmp_path) -> None:
    """A mixed-type GGUF (K-quant, legacy and Q8_0 matrices, a packed embedding and head)
    runs its packed matmuls and lookups as the `pagoda::gemm_packed` and
    `pagoda::dequantize_rows_packed` ops inside the compiled graph."""
    from pagoda.executor.loader.gguf_writer import write_hf_checkpoint as write_gguf
    from tests.executor.test_gguf_packed_models import K_SIZES, mixed_type

    build_checkpoint("llama", str(tmp_path), **K_SIZES)
    path = str(tmp_path / "mixed.gguf")
    write_gguf(str(tmp_path), path, mixed_type)
    kwargs = {"model": path, "tokenizer": bundled_model_path(), "dtype": "float32",
              "kv_cache_memory": 1 << 20, "max_model_len": 64, "block_size": 4}
    eager = LLM(**kwargs)
    compiled = LLM(**kwargs, compile=True)
    assert "PackedLinear" in repr(compiled.engine.runner.model)
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(
        greedy_run(compiled, PROMPTS), greedy_run(eager, PROMPTS)
    ):
        assert tokens == eager_tokens
        torch.testing.assert_close(logprobs, eager_logprobs, rtol=1e-4, atol=1e-4)

"""A decode step of a Llama-family model with packed weights runs its whole decoder stack in
one C call (pagoda/executor/whole_stack_decode.py, csrc/decoder_f32.c), an executor the model
runner chooses. It must give what the eager forward gives: the same greedy tokens and
logprobs within float32 rounding, through batched decode steps beside chunked prefills, for
every layer variant it covers; and it must stand aside for the models and steps it does not
cover. Which executor ran is read where a user reads it: the engine's step counts by
executor (the `pagoda:model_steps_total` metric) and the start-up line."""

from __future__ import annotations

import logging
import re

import gguf
import pytest
import torch
from prometheus_client import generate_latest

from pagoda import LLM, SamplingParams
from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.executor.loader.gguf_writer import write_hf_checkpoint as write_gguf
from pagoda.executor.loader.model_files import bundled_model_path
from tests.executor.test_gguf_packed_models import K_SIZES, mixed_type
from tests.executor.tiny_checkpoints import build_checkpoint

pytestmark = pytest.mark.slow  # (make test-fast skips it)

Q = gguf.GGMLQuantizationType
PROMPTS = [list(range(3, 40)), [120, 4] * 9, [7, 8]]

def k_quants(name: str):
    return Q.Q4_K if name.endswith("proj.weight") else (
        Q.Q8_0 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else None)

def legacy_quants(name: str):
    """Types for inputs that are not whole 256-weight super-blocks (qwen3's o_proj: 128)."""
    return Q.Q5_0 if name.endswith("proj.weight") else None

def tiny_gguf(tmp_path, arch: str, types=k_quants, **overrides) -> str:
    folder = str(tmp_path)
    build_checkpoint(arch, folder, **{**K_SIZES, **overrides})
    path = f"{folder}/model.gguf"
    write_gguf(folder, path, types)
    return path

def engine_of(path: str, **options) -> LLM:
    return LLM(model=path, tokenizer=bundled_model_path(), dtype="float32",
               kv_cache_memory=1 << 21, max_model_len=128, block_size=4,
               max_num_batched_tokens=16, **options)

def decode_kernel(llm: LLM):
    return llm.engine.runner.whole_stack


def whole_stack_steps(llm: LLM) -> int:
    return llm.engine.snapshot().steps_by_executor.get("whole-stack", 0)

def generate_both_ways(llm: LLM, max_tokens: int = 10):
    """(with the kernel, eager) completions of PROMPTS, greedy, with logprobs; and how many
    steps the kernel ran."""
    kernel = decode_kernel(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results, calls = [], whole_stack_steps(llm)
    for enabled in (True, False):
        kernel.enabled = enabled
        results.append([out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)])
        if enabled:
            calls = whole_stack_steps(llm) - calls
    kernel.enabled = True
    return results[0], results[1], calls

def assert_same_completions(fused, eager) -> None:
    for ours, theirs in zip(fused, eager, strict=True):
        assert list(ours.token_ids) == list(theirs.token_ids)
        for position_ours, position_theirs in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert position_ours.keys() == position_theirs.keys()
            for token, logprob in position_ours.items():
                assert abs(logprob.logprob - position_theirs[token].logprob) < 1e-4

@pytest.mark.parametrize("arch, types, window", [
    ("llama", mixed_type, None),  # fused qkv and gate-up of several formats (segments)
    ("llama", k_quants, 8),  # every layer attends its last 8 keys only
    ("qwen2", k_quants, None),  # qkv bias, tied head
    ("qwen3", legacy_quants, None),  # q/k norms, head_dim 32 apart from hidden / heads
    ("phi3", k_quants, None),
])
def test_the_decode_kernel_gives_the_eager_forwards_tokens(arch, types, window,
                                                           tmp_path) -> None:
    llm = engine_of(tiny_gguf(tmp_path, arch, types))
    if window is not None:  # a GGUF llama carries no window: set one on both paths
        for layer in llm.engine.runner.model.attention_layers():
            layer.sliding_window = window
        decode_kernel(llm).forget_plan()  # (planned at start, to log what runs)
    fused, eager, calls = generate_both_ways(llm, max_tokens=16 if window else 10)
    # decode-only steps: after the prompts' chunked prefills, about one a generated token
    assert calls >= 8
    assert_same_completions(fused, eager)

@pytest.mark.parametrize("decode_activations, parts", [("int8", 1), ("int16", 2)])
def test_integer_activations_take_the_kernel_as_the_eager_forward_does(
        decode_activations, parts, tmp_path) -> None:
    """--decode-activations int8 / int16: the whole-stack step quantizes each linear's input
    as the eager PackedLinear does (gemm_int8.c both ways): the same tokens and logprobs."""
    llm = engine_of(tiny_gguf(tmp_path, "llama", mixed_type),
                    decode_activations=decode_activations)
    linear = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert linear.activation_parts == parts
    head = llm.engine.runner.model.quantized_head  # 16-bit only: packed_linear.py
    assert head.activation_parts == (2 if decode_activations == "int16" else 0)
    fused, eager, calls = generate_both_ways(llm)
    assert calls >= 8
    assert_same_completions(fused, eager)
    # and the mode is really on: its logprobs differ from float32 activations'
    exact = engine_of(tiny_gguf(tmp_path / "exact", "llama", mixed_type))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    float32 = [out.outputs[0] for out in exact.generate(PROMPTS, params, use_tqdm=False)]
    assert any(abs(a[t].logprob - b[t].logprob) > 1e-6
               for ours, theirs in zip(fused, float32)
               for a, b in zip(ours.logprobs, theirs.logprobs) for t in a.keys() & b.keys())


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_float_checkpoint_quantized_at_load_takes_the_kernel(quantization, tmp_path) -> None:
    """`--quantization int4/int8` of a Hugging Face folder: QuantizedLinear layers on the
    float32 kernel, described to the decode kernel as one segment each."""
    folder = str(tmp_path)
    build_checkpoint("llama", folder, **K_SIZES)  # head_dim 64: the C attention backend
    llm = engine_of(folder, quantization=quantization)
    fused, eager, calls = generate_both_ways(llm)
    assert calls >= 8
    assert_same_completions(fused, eager)


def test_an_awq_folder_takes_the_kernel(tmp_path) -> None:
    from tests.executor.test_awq_gptq import quantized_checkpoint

    quantized_checkpoint(str(tmp_path), "awq", 32)
    llm = engine_of(str(tmp_path))
    fused, eager, calls = generate_both_ways(llm)
    assert calls >= 8
    assert_same_completions(fused, eager)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_takes_the_kernel_as_the_eager_forward_does(kv_cache_dtype,
                                                                   tmp_path) -> None:
    """--kv-cache-dtype float16 / bfloat16 under float32 activations: the whole-stack step
    reads and writes the 16-bit cache as the eager forward's attention does."""
    llm = engine_of(tiny_gguf(tmp_path, "llama"), kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_caches[0].dtype == getattr(torch, kv_cache_dtype)
    fused, eager, calls = generate_both_ways(llm, max_tokens=16)
    assert calls >= 8
    assert_same_completions(fused, eager)


def test_float_weights_and_an_8_bit_cache_take_the_eager_forward(tmp_path) -> None:
    """The kernel covers packed weights on a float32 cache: a GGUF loaded as float, or a
    quantized cache, decodes the eager way (and still correctly)."""
    path = tiny_gguf(tmp_path, "llama")
    for options in ({"quantization": "none"}, {"kv_cache_dtype": "int8"}):
        llm = engine_of(path, **options)
        fused, eager, calls = generate_both_ways(llm, max_tokens=3)
        assert calls == 0 and decode_kernel(llm).plan() is None
        assert_same_completions(fused, eager)

def moe_quants(name: str):
    """K-quant experts (gate / up Q4_K, down Q6_K) and projections; o_proj (128 inputs where
    heads * head_dim is 128) Q5_0."""
    if name.endswith("o_proj.weight"):
        return Q.Q5_0
    if name.endswith(("down_proj.weight", ".w2.weight")):
        return Q.Q6_K
    return Q.Q4_K if name.endswith(("proj.weight", ".w1.weight", ".w3.weight")) else k_quants(name)


def moe_engine(tmp_path, arch: str) -> LLM:
    """A tiny MoE model with packed experts of 256 inputs (K-quants): Mixtral and Qwen3-MoE
    as GGUF files; GLM-4.5 (grouped sigmoid routing with a correction bias and a scaling
    factor, a shared expert, a dense first layer) from its Hugging Face folder through
    `--quantization int4`: the GGUF converters drop its expert groups."""
    from tests.executor.test_model_families import GGUF_SETTINGS

    if arch == "glm4-moe":
        build_checkpoint(arch, str(tmp_path), **{**K_SIZES, "moe_intermediate_size": 256})
        return engine_of(str(tmp_path), quantization="int4")
    settings = {**GGUF_SETTINGS[arch], "moe_intermediate_size": 256}
    return engine_of(tiny_gguf(tmp_path, arch, moe_quants, **settings))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "glm4-moe"])
def test_a_mixture_of_experts_takes_the_kernel_as_the_eager_forward_does(arch,
                                                                         tmp_path) -> None:
    """MoE layers in the decode step (csrc/moe_f32.c): routing in C and each chosen expert
    once on its rows give the eager forward's tokens and logprobs (whose block routes in
    PyTorch)."""
    llm = moe_engine(tmp_path, arch)
    layers = llm.engine.runner.model.model.layers
    assert any(type(getattr(layer, layer.mlp_name)).__name__ == "SparseMoeBlock"
               for layer in layers)
    fused, eager, calls = generate_both_ways(llm)
    assert calls >= 8
    assert_same_completions(fused, eager)


def test_a_mixture_of_experts_the_kernel_does_not_cover_takes_the_eager_forward(
        tmp_path) -> None:
    """OLMoE's q/k norms span all heads (not the kernel's per-head norms): it stands aside."""
    build_checkpoint("olmoe", str(tmp_path), **K_SIZES)
    llm = engine_of(str(tmp_path), quantization="int8")
    _, _, calls = generate_both_ways(llm, max_tokens=3)
    assert calls == 0 and decode_kernel(llm).plan() is None


def test_which_executor_ran_is_logged_counted_and_exported(tmp_path, caplog) -> None:
    """The start-up line says which executor runs which steps; the engine counts steps by
    executor, and /metrics exports the counts (pagoda:model_steps_total{executor=...})."""
    path = tiny_gguf(tmp_path, "llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="pagoda.executor.runner_builder"):
        packed, dense = engine_of(path), engine_of(path, quantization="none")
    lines = [r.getMessage() for r in caplog.records if "step executors" in r.getMessage()]
    assert "one C call (the whole-stack step" in lines[0]
    assert lines[1] == "step executors: every step eager (op by op)"
    for llm in (packed, dense):
        llm.generate(PROMPTS, params, use_tqdm=False)
    steps, dense_steps = (llm.engine.snapshot().steps_by_executor for llm in (packed, dense))
    assert steps["whole-stack"] >= 5 and steps["eager"] >= 1  # decodes; the prompts' prefills
    assert set(dense_steps) == {"eager"}
    metrics = EngineMetrics("tiny")
    metrics.update(packed.engine.snapshot())
    exported = generate_latest(metrics.registry).decode()
    for executor, count in steps.items():
        assert re.search(rf'pagoda:model_steps_total{{executor="{executor}",model_name="tiny"}}'
                         rf" {float(count)}\b", exported), exported


def test_amx_tiles_take_the_kernel_as_the_eager_forward_does(tmp_path, tmp_path_factory,
                                                             monkeypatch) -> None:
    """AMX tiles forced for every row count (natively where this CPU lends them, else their
    emulation build): the whole-stack step (fused projections written side by side) and the
    eager forward give the vector kernel's tokens and logprobs, exactly (the same integer
    sums, the same epilogue)."""
    from pagoda.executor.kernels import build
    from pagoda.executor.kernels.abi import WeightFormat
    from pagoda.executor.kernels.arithmetic import set_amx_rows
    from tests.executor.test_cpu_kernels import amx_build, isa_build_cache

    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
    monkeypatch.setenv("PAGODA_KERNEL_ISA", amx_build())
    build.load_cpu_kernels.cache_clear()
    try:
        llm = engine_of(tiny_gguf(tmp_path, "llama", mixed_type), decode_activations="int16",
                        enable_prefix_caching=False)  # each run chunks its prompts alike
        vector_fused, vector_eager, _ = generate_both_ways(llm)
        set_amx_rows({format.name.lower(): 1 for format in WeightFormat})
        fused, eager, calls = generate_both_ways(llm)
    finally:
        set_amx_rows({})
        build.load_cpu_kernels.cache_clear()
    assert calls >= 8
    for ours, theirs in ((fused, vector_fused), (eager, vector_eager)):
        for tiles, vectors in zip(ours, theirs, strict=True):
            assert list(tiles.token_ids) == list(vectors.token_ids)
            assert [{t: p.logprob for t, p in position.items()} for position in tiles.logprobs] \
                == [{t: p.logprob for t, p in position.items()} for position in vectors.logprobs]

"""Tensor parallelism (pagoda/executor/parallel/): TP=2 over two local worker processes
gives TP=1's logits (within a float32 rounding bound: `rounding_bound`) and greedy tokens
(wherever the top-2 margin exceeds that bound), over a mixed batch that runs chunked
prefill, prefix-cache hits and preemption; a dead worker ends the engine with a
clear error; no worker outlives its engine."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import EngineFatalError
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer
from tests.process_tree import descendant_pids, wait_until_gone

pytestmark = pytest.mark.slow

SHARED = ("You are a careful assistant. Answer in one short paragraph, plainly, and say "
          "when you do not know. ")
PROMPTS = [SHARED + "What is the capital of France?",
           SHARED + "Name three prime numbers.",
           "Once upon a time",
           "def fibonacci(n):\n    " * 3,
           SHARED + "Why is the sky blue? " * 4]
# A small cache and token budget: prompts are prefilled in chunks, the batch does not fit
# (preemption), and the shared prefix is served from the cache after the first request.
ENGINE = {"dtype": "float32", "num_kv_blocks": 14, "max_model_len": 224,
          "max_num_batched_tokens": 32, "seed": 0}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


def worker_pids() -> set[int]:
    return descendant_pids(command_part=b"pagoda.executor.parallel.worker_process")


def run_mixed_batch(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens, with the top-2 margin (top-1 minus top-2 logprob, the
    same as in logits) each was chosen by."""
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)  # its blocks then serve the shared prefix
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    runs = []
    for output in outputs:
        completion = output.outputs[0]
        margins = []
        for step in completion.logprobs:
            first, second = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
            margins.append(first - second)
        runs.append((completion.token_ids, margins))
    return runs


def rounding_bound(llm: LLM, logits: torch.Tensor) -> float:
    """How far TP=2's float32 logits may sit from TP=1's from summation order alone.

    TP=2 sums each row-parallel matmul (o_proj, down_proj) as two halves, then the
    all-reduce adds them: the same terms in another order (the embedding's and lm_head's
    vocabulary splits add zeros or gather: exact), and the SIMD width (AVX2, AVX-512, AMX-era CPUs) orders them again
    differently. One K-term float32 dot product moves by ~eps * sqrt(K) of its scale
    (rounding errors of random sign; eps * K at worst). Each of the L layers adds such a
    relative change to the residual stream, and they add up (at worst) linearly to the
    logits: eps * sqrt(K) * L times the logits' scale (their largest magnitude), times 4
    for what the norms and softmax amplify. The bundled model (K = 1536, L = 30, |logits|
    up to ~20): 1.1e-2, against 1.2e-4 seen (AVX2 EPYC, AVX-512 BF16 / AMX Xeon); the tiny
    models: ~1.5e-5 against 7e-7. A real fault (a missing all-reduce, a wrong shard, a
    wrong KV head) moves logits by O(1): ~100 times the bound or more."""
    config = llm.engine.runner.model.config
    k = max(config.hidden_size, config.intermediate_size)
    eps = torch.finfo(torch.float32).eps
    return 4 * eps * k**0.5 * config.num_hidden_layers * logits.abs().max().item()


def assert_same_greedy_tokens(runs, expected, bound: float) -> None:
    """Token for token the same, up to a choice between two tokens whose logits TP=1 put
    within 2 * bound of each other (each may move by `bound`: a near tie may go either way,
    and the texts part there)."""
    for (tokens, _), (expected_tokens, margins) in zip(runs, expected, strict=True):
        assert len(tokens) == len(expected_tokens)
        for position, (token, expected_token) in enumerate(zip(tokens, expected_tokens)):
            if token != expected_token:
                assert margins[position] <= 2 * bound, (
                    f"token {position}: {token} != {expected_token}, top-2 margin "
                    f"{margins[position]:.3g} > 2 * {bound:.3g}")
                break


def assert_tp2_matches_tp1(model: str, **options) -> None:
    single = LLM(model, tensor_parallel_size=1, **ENGINE, **options)
    expected = run_mixed_batch(single)
    ids = single.get_tokenizer().encode(PROMPTS[4])
    assert len(ids) > ENGINE["max_num_batched_tokens"]  # prefilled in chunks
    expected_logits = single.engine.runner.prompt_logits([ids])[0]
    bound = rounding_bound(single, expected_logits)
    parallel = LLM(model, tensor_parallel_size=2, **ENGINE, **options)
    try:
        assert len(worker_pids()) == 2
        assert_same_greedy_tokens(run_mixed_batch(parallel), expected, bound)
        snapshot = parallel.engine.snapshot()
        assert snapshot.num_preemptions > 0 and snapshot.prefix_cache_hits > 0
        logits = parallel.engine.runner.prompt_logits([ids])[0]
        error = (logits - expected_logits).abs().max().item()
        print(f"\nTP=2 logits within {error:.3g} of TP=1's (bound {bound:.3g})")
        assert error <= bound, f"TP=2 logits off by {error:.3g}, bound {bound:.3g}"
    finally:
        parallel.engine.shutdown()
    assert worker_pids() == set()


@pytest.mark.parametrize(("arch", "options", "overrides"), [
    ("llama", {}, {}), ("qwen3", {}, {}),
    ("llama", {"quantization": "int8"}, {}),  # int8 linears (Pagoda's kernel: cut as packed q8)
    # (no window: sliding-window layers turn prefix caching off, which the batch exercises)
    ("mixtral", {}, {"sliding_window": None}), ("glm4-moe", {}, {}),
    # experts of 64 rows: 32 a rank, whole blocks of the packed q8 experts (the C MoE kernel)
    ("qwen3-moe", {"quantization": "int8"}, {"moe_intermediate_size": 64}),
    ("llama4", {}, {"attention_chunk_size": None}),  # (chunks: a windowed group, as Mixtral's)
    ("gpt-oss", {}, {"layer_types": ["full_attention"] * 3}),  # (as Mixtral's: no windows)
    # (Granite's and ERNIE's dense models: their MoE ones' attention, the Llama MLP)
    ("granite-moe", {}, {}), ("ernie4.5-moe", {}, {}), ("phimoe", {}, {"sliding_window": None}),
    ("olmoe", {}, {}), ("olmoe", {}, {"num_key_value_heads": 1}),  # (its KV head on both ranks)
    ("deepseek-v2", {}, {}), ("deepseek-v3", {}, {}),
], ids=["llama", "qwen3", "llama-int8", "mixtral", "glm4-moe", "qwen3-moe-int8", "llama4",
        "gpt-oss", "granite-moe", "ernie4.5-moe", "phimoe", "olmoe", "olmoe-one-kv-head",
        "deepseek-v2", "deepseek-v3"])
def test_tiny_models_tp2_equal_tp1(arch, options, overrides, tmp_path) -> None:
    # llama: 4 query heads over 2 KV heads (one each); qwen3: q/k norms, head_dim 32; the
    # MoE models: every expert's rows split, the block's output summed once (GLM-4.5 with
    # its shared expert, grouped routing and a dense first layer; Llama 4 with its NoPE,
    # temperature-tuned and q/k-normed layers and input-scaled MoE; gpt-oss with its sinks,
    # biases everywhere and clamped SwiGLU experts; Granite MoE with its multipliers, ERNIE 4.5
    # MoE with its half-split rotary rows and bias-corrected routing, PhiMoE with its
    # sparse-mixer routing and biased LayerNorm model; OLMoE with its q/k norms over all
    # heads, split over the ranks, and clipped q/k/v; DeepSeek V2-Lite-like (no query latent,
    # group-limited softmax routing) and V3 (query latent, biased sigmoid routing, YaRN), their
    # latent attention split by query heads around the one cached latent)
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), arch, **overrides)
    assert_tp2_matches_tp1(folder, **options)


def test_awq_checkpoint_tp2_equals_tp1(tmp_path) -> None:
    # AWQ's own 4-bit codes (groups of 32), cut as packed q4 on their group grid
    from tests.executor.test_awq_gptq import quantized_checkpoint
    from tests.executor.tiny_checkpoints import bundled_tokenizer

    tokenizer = bundled_tokenizer()
    quantized_checkpoint(str(tmp_path), "awq", 32, vocab_size=len(tokenizer),
                         max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(tmp_path))
    assert_tp2_matches_tp1(str(tmp_path))


def test_compiled_tp2_equals_eager_tp1(tmp_path) -> None:
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "llama")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    expected = LLM(folder, dtype="float32", max_model_len=256).generate(
        PROMPTS[:3], greedy, use_tqdm=False)
    llm = LLM(folder, dtype="float32", max_model_len=256, tensor_parallel_size=2, compile=True)
    try:
        outputs = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in expected]


def test_bundled_model_tp2_equals_tp1() -> None:
    # 9 query heads over 3 KV heads: rank 0 holds 2 KV heads, rank 1 one; Q4_1 weights
    # packed, cut on their 32-input blocks
    assert_tp2_matches_tp1(None)


def test_sampling_stays_in_step_and_a_dead_worker_ends_the_engine(tmp_path) -> None:
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "llama")
    llm = LLM(folder, tensor_parallel_size=2, dtype="float32", max_model_len=256)
    try:
        # random sampling: every rank draws the same tokens, or the runner says so
        sampled = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=1.0),
                               use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) > 0 for o in sampled)
        (victim,) = [p.pid for p in llm.engine.runner.workers.processes[1:]]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EngineFatalError, match="rank 1"):
            llm.engine.runner.execute_model(llm.engine._scheduler.schedule())
    finally:
        llm.engine.shutdown()
    assert wait_until_gone(b"pagoda.executor.parallel.worker_process") == set()


def test_models_it_cannot_split_are_refused_before_any_worker_starts(tmp_path) -> None:
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "gemma2")
    with pytest.raises(ValueError, match="Llama family"):
        LLM(folder, tensor_parallel_size=2)
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path / "l"), "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        LLM(folder, tensor_parallel_size=3)
    assert worker_pids() == set()

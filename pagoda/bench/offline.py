"""Offline benchmarks on the engine itself, no HTTP: `bench throughput` and `bench latency`.

Both build prompts of random ordinary token ids (no text round trip: the offline API takes
ids) and generate with ignore_eos, so every request produces exactly `output_len` tokens.
A short untimed warm-up runs first. Prompts never repeat, so the prefix cache gives nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
from tqdm import tqdm

from pagoda.bench.datasets import random_token_ids, sample_lengths, sampleable_token_ids
from pagoda.bench.metrics import describe

logger = logging.getLogger(__name__)


def random_prompts(
    tokenizer, num_prompts: int, input_len: int, range_ratio: float, seed: int
) -> list[list[int]]:
    """The fixed workload of `bench throughput` (the transformers baseline builds the same)."""
    rng = np.random.default_rng(seed)
    vocab_ids = sampleable_token_ids(tokenizer)
    lengths = sample_lengths(rng, input_len, range_ratio, num_prompts)
    return [random_token_ids(rng, vocab_ids, n) for n in lengths]


def _greedy_fixed_length(output_len: int):
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                          temperature=0.0)


def _warm_up(llm, vocab_ids: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed + 1_000_003)
    prompts = [random_token_ids(rng, vocab_ids, 16) for _ in range(2)]
    llm.generate(prompts, _greedy_fixed_length(4), use_tqdm=False)


def run_throughput(
    llm, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
    seed: int = 0,
) -> dict:
    """Generate for the whole workload at once; return the summary of `bench throughput`."""
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(tokenizer, num_prompts, input_len, range_ratio, seed)
    _warm_up(llm, sampleable_token_ids(tokenizer), seed)
    before = llm.engine.snapshot()
    start = time.perf_counter()
    outputs = llm.generate(prompts, _greedy_fixed_length(output_len), use_tqdm=True)
    elapsed = time.perf_counter() - start
    after = llm.engine.snapshot()
    batch_sizes = Counter(after.batch_sizes)
    batch_sizes.subtract(before.batch_sizes)
    batch_sizes = {k: v for k, v in sorted(batch_sizes.items()) if v > 0}
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_steps = after.num_steps - before.num_steps
    return throughput_summary(num_prompts, num_prompt_tokens, num_output_tokens, elapsed,
                              batch_sizes, num_steps)


def throughput_summary(
    num_requests: int, num_prompt_tokens: int, num_output_tokens: int, elapsed: float,
    batch_sizes: dict[int, int], num_steps: int,
) -> dict:
    """The JSON summary shared by `bench throughput` and the transformers baseline."""
    total_steps = sum(batch_sizes.values())
    mean_batch = sum(k * v for k, v in batch_sizes.items()) / total_steps if total_steps else None
    return {
        "num_requests": num_requests,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed,
        "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / elapsed,
        "num_steps": num_steps,
        "batch_sizes": {str(k): v for k, v in batch_sizes.items()},
        "mean_batch_size": mean_batch,
    }


def format_throughput(summary: dict, engine: str) -> str:
    batch_sizes = ", ".join(f"{k}x{v}" for k, v in summary["batch_sizes"].items())
    lines = [
        (f"Throughput ({engine}): {summary['num_requests']} requests, "
         f"{summary['num_prompt_tokens']} prompt + {summary['num_output_tokens']} output tokens "
         f"in {summary['elapsed_s']:.2f} s"),
        f"  requests/s:          {summary['requests_per_s']:.2f}",
        f"  output tokens/s:     {summary['output_tokens_per_s']:.1f}",
        f"  total tokens/s:      {summary['total_tokens_per_s']:.1f}",
        f"  steps:               {summary['num_steps']}"
        + (f" (mean batch {summary['mean_batch_size']:.1f} requests)"
           if summary["mean_batch_size"] else ""),
        f"  batch sizes (requests x steps): {batch_sizes}",
    ]
    return "\n".join(lines)


def run_latency(
    llm, input_len: int, output_len: int, num_iters: int, num_warmup_iters: int = 1,
    seed: int = 0,
) -> tuple[dict, list[dict]]:
    """One request at a time, each with a fresh prompt; return the summary and the
    per-iteration figures (TTFT = prefill, decode tokens/s after the first token)."""
    if output_len < 2:
        raise ValueError("--output-len must be >= 2 to measure decoding")
    tokenizer = llm.get_tokenizer()
    vocab_ids = sampleable_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    params = _greedy_fixed_length(output_len)
    iterations: list[dict] = []
    total = num_warmup_iters + num_iters
    for i in tqdm(range(total), desc="Latency iterations", unit="it"):
        prompt = random_token_ids(rng, vocab_ids, input_len)
        start = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        if i < num_warmup_iters:
            continue
        m = output.metrics
        num_tokens = len(output.outputs[0].token_ids)
        ttft = m.first_token_time - m.arrival_time
        decode_time = m.finished_time - m.first_token_time
        iterations.append({
            "ttft_s": ttft,
            "e2el_s": m.finished_time - m.arrival_time,
            "wall_s": wall,
            "num_output_tokens": num_tokens,
            "decode_tokens_per_s": (num_tokens - 1) / decode_time if decode_time > 0 else None,
        })
    summary = {
        "num_iters": num_iters,
        "ttft_s": describe([it["ttft_s"] for it in iterations]),
        "e2el_s": describe([it["e2el_s"] for it in iterations]),
        "decode_tokens_per_s": describe(
            [it["decode_tokens_per_s"] for it in iterations if it["decode_tokens_per_s"]]
        ),
    }
    summary["prefill_tokens_per_s"] = (
        input_len / summary["ttft_s"]["median"] if summary["ttft_s"]["median"] else None
    )
    return summary, iterations


def weight_traffic(llm, decode_tokens_per_s: float | None) -> dict | None:
    """The decode step's weight traffic beside this machine's read bandwidth
    (pagoda/bench/weight_traffic.py); None where the model is not in this process (tensor
    parallelism runs it in workers)."""
    from torch import nn

    from pagoda.bench.weight_traffic import decode_weight_bytes, read_bandwidth

    model = getattr(llm.engine.runner, "model", None)
    if not isinstance(model, nn.Module) or not decode_tokens_per_s:
        return None
    weight_bytes = decode_weight_bytes(model)
    achieved, bandwidth = weight_bytes * decode_tokens_per_s, read_bandwidth()
    return {"weight_bytes_per_token": weight_bytes, "weight_read_bytes_per_s": achieved,
            "memory_read_bytes_per_s": bandwidth, "fraction_of_read_bandwidth": achieved / bandwidth}


def format_latency(summary: dict, input_len: int, output_len: int) -> str:
    ttft, decode, e2e = summary["ttft_s"], summary["decode_tokens_per_s"], summary["e2el_s"]
    traffic = summary.get("weight_traffic")
    memory_line = [] if traffic is None else [
        (f"  weights read:        {traffic['weight_bytes_per_token'] / 1e9:.3f} GB per token x "
         f"median decode = {traffic['weight_read_bytes_per_s'] / 1e9:.1f} GB/s, "
         f"{traffic['fraction_of_read_bandwidth']:.0%} of this machine's measured read "
         f"bandwidth ({traffic['memory_read_bytes_per_s'] / 1e9:.1f} GB/s)")]
    return "\n".join([
        (f"Latency: {summary['num_iters']} single requests of {input_len} prompt + "
         f"{output_len} output tokens"),
        (f"  TTFT (prefill) ms:   mean {ttft['mean'] * 1000:.1f}, median "
         f"{ttft['median'] * 1000:.1f}, p90 {ttft['p90'] * 1000:.1f}, "
         f"p99 {ttft['p99'] * 1000:.1f}  (about {summary['prefill_tokens_per_s']:.0f} "
         "prompt tokens/s)"),
        f"  decode tokens/s:     mean {decode['mean']:.1f}, median {decode['median']:.1f}",
        f"  end-to-end ms:       mean {e2e['mean'] * 1000:.1f}, median {e2e['median'] * 1000:.1f}",
        *memory_line,
    ])

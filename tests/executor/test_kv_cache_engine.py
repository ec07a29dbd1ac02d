"""The 8-bit KV cache end to end: the bundled model through LLM() with `kv_cache_dtype`
int8 against `auto` (decode steps through the C kernel, which writes and reads the 8-bit
cache; prompts through the torch path), the cache's token capacity, and the CLI flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Once upon a time", "The three primary colors are",
           "Explain photosynthesis in one sentence.", "import numpy as np\n",
           "My favourite food is"]
MAX_TOKENS = 32
KV_CACHE_MEMORY = 16 << 20


def greedy_tokens(kv_cache_dtype: str) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens, and the KV blocks the engine's cache has."""
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV_CACHE_MEMORY)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.snapshot().num_kv_blocks


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_int8_cache_generates_what_the_float_cache_does() -> None:
    """Greedy decoding flips at the first near-tie and then follows another path, so the
    measure is the share of tokens before each prompt's first difference. Measured here
    (AVX2 EPYC, float32 + int4 weights, 8 prompts x 32 tokens): 73% of the tokens, 4 of
    the 8 outputs identical (fp8_e4m3: 74%, fp8_e5m2: 56%; a cache with wrong scales or
    slots gives ~0). Teacher-forced fidelity: test_fidelity.py."""
    reference, float_blocks = greedy_tokens("auto")
    quantized, int8_blocks = greedy_tokens("int8")
    # the same kv_cache_memory: 64 + 2 bytes a row against 256 (float32 here; bf16 on
    # AVX-512 BF16 CPUs, 128)
    assert int8_blocks >= 1.9 * float_blocks
    prefixes = [common_prefix(a, b) for a, b in zip(reference, quantized)]
    share = sum(prefixes) / sum(len(a) for a in reference)
    print(f"\nint8 cache: common prefixes {prefixes}, {share:.0%} of the tokens")
    assert share >= 0.5
    assert sum(a == b for a, b in zip(reference, quantized)) >= 3
    assert all(len(b) > 0 for b in quantized)


def test_serve_help_lists_the_kv_cache_dtype_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--help"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "--kv-cache-dtype" in result.stdout
    for choice in ("fp8_e4m3", "fp8_e5m2", "int8"):
        assert choice in result.stdout


def test_a_bad_kv_cache_dtype_is_a_one_line_cli_error() -> None:
    result = subprocess.run([sys.executable, "-m", "pagoda", "generate", "--kv-cache-dtype",
                             "q8_0", "hello"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--kv-cache-dtype" in result.stderr and "int8" in result.stderr


def test_llm_rejects_a_bad_kv_cache_dtype() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="int4")

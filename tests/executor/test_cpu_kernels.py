"""Pagoda's C kernels (pagoda/executor/kernels/cpu_kernels.c) against torch references:
the group-quantized matmul in both formats and every row count, the packing that re-finds
GGUF Q4_1 / Q8_0 codes, and attention over a scattered paged cache (decodes, prefills,
chunked prefills, sliding window).

The project's machines (and CI's) have gcc and AVX-512 BF16, so all of this runs there; on a
CPU without AVX-512 BF16 the first test checks instead that the kernels stand aside (and the
rest, which would have nothing to call, are skipped for that reason only)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend, select_backend
from pagoda.executor.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from pagoda.executor.kernels.build import build_library, cpu_flags
from pagoda.executor.kernels.ops import gemm_q, kernels_available, paged_attention
from pagoda.executor.kernels.packing import GROUP_K, pack, quantize_groups
from tests.executor.test_attention_backend import run_step

CPU_HAS_AVX512_BF16 = "avx512_bf16" in cpu_flags().split()


def test_the_kernels_build_and_run_where_the_cpu_has_avx512_bf16() -> None:
    """A build error or a missing kernel on such a CPU is a regression, not a silent fallback."""
    assert build_library().exists()
    assert kernels_available() == CPU_HAS_AVX512_BF16


def test_a_build_without_avx512_bf16_says_so_and_exports_no_kernel(tmp_path, monkeypatch) -> None:
    """What a CPU without the feature gets: the availability check (0), no kernel symbols
    (load_cpu_kernels checks before declaring any)."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    lib = ctypes.CDLL(str(build_library(extra_flags=("-mno-avx512bf16",))))
    assert lib.pagoda_kernels_available() == 0
    with pytest.raises(AttributeError):
        lib.pagoda_gemm_q  # noqa: B018


needs_kernels = pytest.mark.skipif(not CPU_HAS_AVX512_BF16, reason="this CPU lacks AVX-512 BF16")


def gguf_like_weight(format: str, out_features: int, in_features: int):
    """A weight as GGUF's Q4_1 / Q8_0 quantizers leave it: float16 scales, each group's
    codes reaching the extremes (Q4_1: 0 and 15; Q8_0: +-127)."""
    groups = in_features // GROUP_K
    d = (torch.rand(out_features, groups) * 0.01 + 0.001).half().float()
    if format == "q4":
        codes = torch.randint(0, 16, (out_features, groups, GROUP_K))
        codes[..., 0], codes[..., 1] = 0, 15
        m = (-torch.rand(out_features, groups) * 0.1).half().float()
        weight = d[..., None] * codes + m[..., None]
    else:
        codes = torch.randint(-127, 128, (out_features, groups, GROUP_K))
        codes[..., 0] = 127 * torch.where(torch.rand(out_features, groups) < 0.5, 1, -1)
        weight = d[..., None] * codes
    return weight.view(out_features, in_features), codes.view(out_features, in_features), d


@pytest.mark.parametrize("format", ["q4", "q8"])
def test_quantize_groups_recovers_gguf_codes(format) -> None:
    torch.manual_seed(0)
    weight, codes, d = gguf_like_weight(format, 32, 128)
    quantized = quantize_groups(weight, format)
    assert torch.equal(quantized.codes.long(), codes)
    assert torch.equal(quantized.scales.float(), d)
    torch.testing.assert_close(quantized.dequantize(), weight, rtol=0, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("format", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21])
def test_gemm_q_matches_a_matmul_by_the_dequantized_weight(format, rows) -> None:
    """Every row count (one pass holds 8 rows for q4, 16 for q8; 21 takes several) against
    x @ W^T with W dequantized and rounded to bf16, as the kernel multiplies it."""
    torch.manual_seed(rows)
    weight = torch.randn(96, 160) * 0.05
    quantized = quantize_groups(weight, format)
    codes, scales, mins = pack(quantized)
    x = torch.randn(rows, 160).bfloat16()
    out = gemm_q(x, codes, scales, mins, format, 96)
    expected = x.float() @ quantized.dequantize().bfloat16().float().T
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@needs_kernels
def test_gemm_q_rejects_a_float32_input() -> None:
    quantized = quantize_groups(torch.randn(16, 32), "q8")
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_q(torch.randn(2, 32), *pack(quantized), "q8", 16)


def test_packing_rejects_shapes_the_kernel_cannot_tile() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        quantize_groups(torch.randn(20, 64), "q4")


SMOLLM_HEADS = (9, 3, 64)  # query heads, KV heads, head dim


@needs_kernels
@pytest.mark.parametrize(
    "seqs",
    [
        [(40, 1)],  # one stream, several blocks
        [(7, 1), (0, 1), (130, 1), (33, 1)],  # decodes only, lengths off the 16-lane grid
        [(0, 5), (70, 1), (3, 6), (12, 1)],  # decodes (kernel) mixed with prefills (torch)
    ],
)
@pytest.mark.parametrize("heads", [SMOLLM_HEADS, (4, 4, 32), (8, 1, 128)])
def test_kernel_attention_matches_naive_attention(seqs, heads) -> None:
    out, expected = run_step(seqs, backend_class=CpuKernelAttentionBackend, dtype=torch.bfloat16,
                             heads=heads, block_size=16, num_blocks=64)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernels
def test_kernel_attention_sliding_window() -> None:
    out, expected = run_step([(50, 1), (9, 1), (2, 9)], window=20, seed=3,
                             backend_class=CpuKernelAttentionBackend, dtype=torch.bfloat16,
                             heads=SMOLLM_HEADS, block_size=16, num_blocks=64)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernels
def test_kernel_attention_takes_prefill_tokens_against_their_causal_prefix() -> None:
    """The kernel itself (the backend feeds it decodes only, see cpu_backend.py): a 150-token
    prompt, each token attending keys 0 .. its position, against float32 causal attention."""
    torch.manual_seed(0)
    num_tokens, (heads, kv_heads, dim) = 150, SMOLLM_HEADS
    kv_cache = torch.randn(2, kv_heads, 16, 16, dim).bfloat16()
    table = torch.randperm(16)[:10].view(1, 10)  # scattered blocks
    query = torch.randn(num_tokens, heads, dim).bfloat16()
    out = paged_attention(query, kv_cache, table, torch.zeros(num_tokens, dtype=torch.long),
                          torch.arange(1, num_tokens + 1), dim**-0.5, None)
    keys, values = (kv_cache[i][:, table[0]].reshape(kv_heads, -1, dim)[:, :num_tokens]
                    for i in (0, 1))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys.float(), values.float(), is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernels
def test_kernel_writes_the_decode_steps_keys_and_values_as_it_attends() -> None:
    """new_keys: the kernel stores each token's K/V row at its slot (the cache ends up as
    write_kv_cache leaves it, nothing else touched) and attends with it. K/V come as views of
    one fused (tokens, q + k + v) tensor, as the model hands them over."""
    torch.manual_seed(1)
    (heads, kv_heads, dim), seqs, block_size = SMOLLM_HEADS, 5, 16
    kv_cache = torch.randn(2, kv_heads, 24, block_size, dim).bfloat16()
    tables = torch.randperm(24)[:15].view(seqs, 3)  # scattered blocks, 3 per sequence
    key_lens = torch.tensor([1, 17, 40, 33, 48])  # the new token is the last of each
    slots = tables.gather(1, ((key_lens - 1) // block_size).view(-1, 1)).view(-1) * block_size \
        + (key_lens - 1) % block_size
    fused = torch.randn(seqs, (heads + 2 * kv_heads) * dim).bfloat16()
    query, key, value = (t.view(seqs, -1, dim) for t in fused.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    assert not key.is_contiguous()
    expected_cache = kv_cache.clone()
    write_kv_cache(key, value, expected_cache, slots)
    expected = paged_attention(query, expected_cache, tables, torch.arange(seqs), key_lens,
                               dim**-0.5, None)
    out = paged_attention(query, kv_cache, tables, torch.arange(seqs), key_lens, dim**-0.5, None,
                          new_keys=(key, value, slots))
    assert torch.equal(kv_cache, expected_cache)
    assert torch.equal(out, expected)


@needs_kernels
def test_the_kernel_backend_is_chosen_only_where_it_applies() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend(16, cpu, torch.bfloat16, 9, 3, 64, None),
                      CpuKernelAttentionBackend)
    for dtype, heads in [(torch.float32, (9, 3, 64)), (torch.bfloat16, (4, 4, 8))]:
        backend = select_backend(16, cpu, dtype, *heads, None)
        assert type(backend) is TorchAttentionBackend

"""The 8-bit KV cache (`kv_cache_dtype` int8 / fp8_e4m3 / fp8_e5m2, attention/kv_quant.py):
round-trip error bounds; the C kernel's quantization bit for bit torch's; attention on a
quantized cache, torch backend against naive attention over the dequantized values and the C
kernel against the torch backend (decodes, prefills, chunked prefills, GQA, sliding window);
the backend choice; the cache sizing; the config value's validation. The engine-level and
fidelity checks: test_kv_cache_engine.py and test_fidelity.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend, select_backend
from pagoda.executor.attention.kv_quant import (
    FLOAT8,
    QMAX,
    QuantizedKVCache,
    code_dtype,
    dequantize,
    key_rotation,
    quantize,
    rotate_keys,
)
from pagoda.executor.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from pagoda.executor.kernels.ops import paged_attention
from pagoda.executor.kv_cache_allocation import allocate_kv_caches, determine_num_blocks
from tests.executor.test_attention_backend import reference_attention

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
SMOLLM_HEADS = (9, 3, 64)
RELATIVE_STEP = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
"""Half an ulp of the format's mantissa (3 or 2 bits): the most relative rounding error of a
normal float8 value."""


def empty_cache(fmt: str, shape: tuple) -> QuantizedKVCache:
    return QuantizedKVCache(torch.zeros(shape, dtype=code_dtype(fmt)),
                            torch.zeros(shape[:-1], dtype=torch.bfloat16), fmt)


def clone(cache: QuantizedKVCache) -> QuantizedKVCache:
    return QuantizedKVCache(cache.codes.clone(), cache.scales.clone(), cache.kv_cache_dtype)


def assert_same_cache(a: QuantizedKVCache, b: QuantizedKVCache) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))


# ---- quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_bounded(fmt) -> None:
    """Rows over 12 orders of magnitude, one with an outlier: every value comes back within
    half a step of its row's grid (int8: half a scale; fp8: half an ulp relative, or half the
    smallest subnormal step), and nothing clips (the scale is rounded up)."""
    torch.manual_seed(0)
    x = torch.randn(256, 3, 64) * torch.logspace(-6, 6, 256)[:, None, None]
    x[7, 1, 5] *= 50.0  # an outlier channel
    codes, scales = quantize(x, fmt)
    assert codes.dtype == code_dtype(fmt) and scales.dtype == torch.bfloat16
    assert scales.shape == x.shape[:-1]
    scale = scales.float()[..., None]
    # the row's largest value maps within the format's range, and uses most of it
    ratio = x.abs().amax(-1) / scales.float()
    assert (ratio <= QMAX[fmt]).all() and (ratio >= QMAX[fmt] * 0.99).all()
    error = (dequantize(codes, scales, fmt, torch.float32) - x).abs()
    if fmt == "int8":
        bound = 0.5 * scale * (1 + 1e-6)
    else:
        smallest_subnormal = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}[fmt]
        bound = torch.maximum(RELATIVE_STEP[fmt] * x.abs(), 0.5 * smallest_subnormal * scale)
        bound = bound * (1 + 1e-6)
    assert (error <= bound).all()
    relative_rms = (error.norm(dim=-1) / x.norm(dim=-1))
    relative_rms[7, 1] = 0  # the outlier's row: its scale spreads the others over few codes
    relative_rms = relative_rms.max().item()
    assert relative_rms < {"int8": 0.01, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_zero_row_stays_zero(fmt) -> None:
    codes, scales = quantize(torch.zeros(2, 64), fmt)
    assert (scales.float() > 0).all()
    assert torch.equal(dequantize(codes, scales, fmt, torch.float32), torch.zeros(2, 64))


def tie_rows(fmt: str, dim: int) -> torch.Tensor:
    """Rows whose scale is exactly 1 (amax = QMAX) holding every code's value and every
    midpoint between neighbouring codes (ties, which round to even) with both signs."""
    if fmt == "int8":
        values = torch.arange(-127, 128, dtype=torch.float32)
    else:
        values = torch.arange(256, dtype=torch.uint8).view(FLOAT8[fmt]).float()
        values = values[values.isfinite() & (values.abs() <= QMAX[fmt])].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    pool = torch.cat([values, midpoints, torch.tensor([-0.0, 0.0])])
    rows = -(-len(pool) // (dim - 1))
    pool = torch.cat([pool, torch.zeros(rows * (dim - 1) - len(pool))]).view(rows, dim - 1)
    return torch.cat([pool, torch.full((rows, 1), QMAX[fmt])], dim=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_quantizes_as_torch_does_bit_for_bit(fmt) -> None:
    """The decode step's K/V written by the C kernel (new_keys) against write_kv_cache: ties,
    signed zeros, an all-zero row, rows from 1e-30 to 1e4."""
    torch.manual_seed(1)
    dim, kv_heads, block_size = 64, 1, 16
    ties = tie_rows(fmt, dim)
    spread = torch.randn(64, dim) * torch.logspace(-30, 4, 64)[:, None]
    rows = torch.cat([ties, spread, torch.zeros(1, dim)])
    n = len(rows)
    num_blocks = -(-n // block_size)
    shape = (2, kv_heads, num_blocks, block_size, dim)
    cache, expected = empty_cache(fmt, shape), empty_cache(fmt, shape)
    slots = torch.randperm(num_blocks * block_size)[:n]
    key, value = rows.view(n, 1, dim), rows.flip(0).contiguous().view(n, 1, dim)
    write_kv_cache(key, value, expected, slots)
    # one decode token per "sequence": a one-block table holding its slot's block
    tables = (slots // block_size).view(n, 1)
    key_lens = slots % block_size + 1
    query = torch.randn(n, 1, dim)
    paged_attention(query, cache, tables, torch.arange(n), key_lens, dim**-0.5, None,
                    new_keys=(key, value, slots))
    assert_same_cache(cache, expected)


# ---- attention -----------------------------------------------------------------------------


def step_on_cache(cache, clone, seqs, heads, block_size, num_blocks, window, seed):
    """One step on `cache` (num_blocks of block_size, stale contents) with scattered blocks:
    earlier steps' K/V written with write_kv_cache, then the step run by the torch backend
    and by the kernel backend, each on its own clone(cache). seqs: (num_computed,
    num_scheduled) per sequence. Returns [(output, cache after it)] for the two backends,
    every sequence's K and V (float32), the queries and the scheduled counts."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    free = rng.permutation(num_blocks)
    tables, start = np.zeros((len(seqs), max(blocks_needed)), dtype=np.int64), 0
    for i, count in enumerate(blocks_needed):
        tables[i, :count] = free[start:start + count]
        start += count
    full_k = [3 * torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    for i, (computed, _) in enumerate(seqs):
        pos = np.arange(computed)
        slots = torch.from_numpy(tables[i, pos // block_size] * block_size + pos % block_size)
        write_kv_cache(full_k[i][:computed], full_v[i][:computed], cache, slots)
    computed = np.array([c for c, _ in seqs])
    scheduled = np.array([n for _, n in seqs])
    q = torch.randn(int(scheduled.sum()), num_heads, head_dim, generator=gen)
    k = torch.cat([full_k[i][c:] for i, (c, _) in enumerate(seqs)])
    v = torch.cat([full_v[i][c:] for i, (c, _) in enumerate(seqs)])
    results = []
    for backend_class in (TorchAttentionBackend, CpuKernelAttentionBackend):
        backend = backend_class(block_size, torch.device("cpu"), window)
        backend.kv_cache_shape(num_blocks, num_kv_heads, head_dim)
        metadata = backend.build_metadata(computed, scheduled, tables)
        layer_cache = clone(cache)
        out = backend.forward(q, k, v, layer_cache, metadata, head_dim**-0.5)
        assert out.dtype == torch.float32
        results.append((out, layer_cache))
    return results, full_k, full_v, q, scheduled


def reference_over(q, scheduled, keys, values, seqs, window):
    """Naive attention of each sequence's queries over its keys / values as the cache
    holds them (float32)."""
    return torch.cat([
        reference_attention(q_rows, keys[i], values[i], seqs[i][0], window)
        for i, q_rows in enumerate(q.split(scheduled.tolist()))
    ])


def quantized_step(seqs, fmt, heads, block_size=16, num_blocks=64, window=None, seed=0):
    """One step (step_on_cache) on a quantized cache whose other slots hold random codes:
    (torch backend output, cache after it), (kernel backend output, cache after it) and
    naive attention over the dequantized values."""
    _, num_kv_heads, head_dim = heads
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    cache = empty_cache(fmt, shape)
    stale_codes, stale_scales = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(
        seed + 1)), fmt)
    cache.codes.copy_(stale_codes)
    cache.scales.copy_(stale_scales)
    results, full_k, full_v, q, scheduled = step_on_cache(cache, clone, seqs, heads, block_size,
                                                          num_blocks, window, seed)
    # naive attention over what the cache holds: each sequence's K/V quantized and back
    def round_trip(x):
        return dequantize(*quantize(x, fmt), fmt, torch.float32)
    expected = reference_over(q, scheduled, [round_trip(k) for k in full_k],
                              [round_trip(v) for v in full_v], seqs, window)
    return results[0], results[1], expected


STEPS = [
    [(40, 1)],  # one stream, several blocks
    [(7, 1), (0, 1), (130, 1), (33, 1)],  # decodes only: the kernel writes and reads
    [(0, 5), (70, 1), (3, 6), (12, 1)],  # prefills (torch) and decodes (kernel) mixed
    [(0, 37), (0, 9)],  # prompts from position 0
    [(20, 17), (16, 3)],  # chunked prefills after a cached prefix
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("heads", [SMOLLM_HEADS, (4, 4, 32), (8, 1, 128)])
def test_kernel_attention_on_a_quantized_cache_matches_the_torch_backend(fmt, seqs, heads) -> None:
    (torch_out, torch_cache), (kernel_out, kernel_cache), expected = quantized_step(
        seqs, fmt, heads)
    assert_same_cache(torch_cache, kernel_cache)
    torch.testing.assert_close(torch_out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seqs", [[(50, 1), (9, 1), (30, 1)], [(50, 1), (9, 1), (2, 9)]])
def test_quantized_attention_sliding_window(fmt, seqs) -> None:
    (torch_out, torch_cache), (kernel_out, kernel_cache), expected = quantized_step(
        seqs, fmt, SMOLLM_HEADS, window=20, seed=3)
    assert_same_cache(torch_cache, kernel_cache)
    torch.testing.assert_close(torch_out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)


def test_bfloat16_activations_read_a_quantized_cache_through_torch() -> None:
    """The 8-bit cache's kernel is float32 only: bf16 runs take the torch backend, which
    dequantizes the gathered tiles to bf16."""
    cpu = torch.device("cpu")
    for fmt in FORMATS:
        assert type(select_backend(16, cpu, torch.bfloat16, *SMOLLM_HEADS, None, fmt)) is (
            TorchAttentionBackend)
        assert isinstance(select_backend(16, cpu, torch.float32, *SMOLLM_HEADS, None, fmt),
                          CpuKernelAttentionBackend)
    # a 6-token prompt in bf16 and in float32 (the same K/V values, so the same codes)
    backend = TorchAttentionBackend(16, cpu)
    backend.kv_cache_shape(4, 3, 64)
    metadata = backend.build_metadata(np.array([0]), np.array([6]), np.arange(1)[None])
    torch.manual_seed(5)
    q, k, v = torch.randn(6, 9, 64), torch.randn(6, 3, 64), torch.randn(6, 3, 64)
    k, v = k.bfloat16().float(), v.bfloat16().float()
    bf16_cache, f32_cache = empty_cache("int8", (2, 3, 4, 16, 64)), empty_cache("int8", (2, 3, 4, 16, 64))
    out_bf16 = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), bf16_cache, metadata, 0.125)
    out_f32 = backend.forward(q, k, v, f32_cache, metadata, 0.125)
    assert_same_cache(bf16_cache, f32_cache)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), out_f32, atol=3e-2, rtol=3e-2)


def test_paged_attention_refuses_bf16_queries_on_a_quantized_cache() -> None:
    cache = empty_cache("int8", (2, 1, 2, 16, 64))
    with pytest.raises(ValueError, match="float32 queries"):
        paged_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), cache,
                        torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                        torch.ones(1, dtype=torch.long), 0.125, None)


# ---- sizing and config ---------------------------------------------------------------------


def fake_runner(dtype: torch.dtype, kv_cache_dtype: str, memory: int):
    """A ModelRunner of a stand-in model with the bundled model's attention shapes (30
    layers, 9 heads, 3 KV heads, head_dim 64): enough for the cache sizing."""
    from pagoda.executor.model_runner import ModelRunner

    config = types.SimpleNamespace(vocab_size=49152, num_hidden_layers=30,
                                   num_key_value_heads=3, num_attention_heads=9,
                                   hidden_size=576, head_dim=64)
    model = types.SimpleNamespace(config=config, sliding_window=None,
                                  attention_layers=lambda: [types.SimpleNamespace(
                                      keys_window=None, num_heads=9, num_kv_heads=3, head_dim=64,
                                      values_in_keys=False)] * 30)
    return ModelRunner(model, torch.device("cpu"), dtype,
                       CacheConfig(kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype), [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_same_memory_holds_about_twice_the_tokens_of_16_bits(fmt) -> None:
    memory = 64 << 20
    scheduler = SchedulerConfig(max_num_seqs=1024)

    def blocks(dtype, kv_cache_dtype):
        return determine_num_blocks(fake_runner(dtype, kv_cache_dtype, memory), 8192, scheduler)

    quantized = blocks(torch.float32, fmt)
    assert quantized >= 1.9 * blocks(torch.bfloat16, "auto")
    assert quantized >= 3.8 * blocks(torch.float32, "auto")
    # codes and scales counted: 64 code bytes + 2 scale bytes a row
    assert fake_runner(torch.float32, fmt, memory).kv_bytes_per_token == 2 * 30 * 3 * (64 + 2)


def test_the_allocated_cache_fits_the_memory_it_was_sized_for() -> None:
    runner = fake_runner(torch.float32, "int8", 1 << 20)
    num_blocks = determine_num_blocks(runner, 4096, SchedulerConfig())
    caches = allocate_kv_caches(runner.backend.kv_cache_shape(num_blocks, 3, 64), 30,
                                torch.float32, torch.device("cpu"), "int8")
    total = sum(c.codes.numel() + 2 * c.scales.numel() for c in caches)
    assert total <= 1 << 20 and total == num_blocks * runner.block_size * runner.kv_bytes_per_token
    assert caches[0].codes.shape == (2, 3, num_blocks, 16, 64)
    assert caches[0].scales.shape == (2, 3, num_blocks, 16)
    # layers do not overlap: writing one leaves the others zero
    caches[0].codes.fill_(1)
    caches[0].scales.fill_(1)
    assert not caches[1].codes.any() and not caches[29].scales.float().any()


def test_kv_cache_dtype_is_validated_and_fp8_is_e4m3() -> None:
    assert CacheConfig().kv_cache_dtype == "auto"
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    for fmt in FORMATS:
        assert CacheConfig(kv_cache_dtype=fmt).kv_cache_dtype == fmt
    with pytest.raises(ValueError, match="auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8"):
        CacheConfig(kv_cache_dtype="q8_0")


def test_a_quantized_cache_is_refused_off_cpu() -> None:
    from pagoda.executor.model_runner import ModelRunner

    runner = fake_runner(torch.float32, "int8", 1 << 20)
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner(runner.model, torch.device("meta"), torch.float32,
                    CacheConfig(kv_cache_dtype="int8"), [])


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_the_key_rotation_keeps_scores_and_spreads_outlier_channels(head_dim) -> None:
    """Queries and keys multiplied by the same orthogonal R give the same scores; keys whose
    magnitude sits in two channels quantize with less than half the score error rotated (what
    the attention layer does before a quantized cache: kv_quant.py)."""
    rotation = key_rotation(head_dim)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(head_dim), atol=1e-5, rtol=0)
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(8, head_dim, generator=generator)
    keys = torch.randn(256, head_dim, generator=generator)
    keys[:, :2] *= 30  # outlier channels, as real keys have
    scores = queries @ keys.T
    torch.testing.assert_close(rotate_keys(queries) @ rotate_keys(keys).T, scores,
                               atol=1e-3, rtol=1e-4)

    def score_error(q: torch.Tensor, k: torch.Tensor) -> float:
        codes, scales = quantize(k, "int8")
        return (q @ dequantize(codes, scales, "int8", torch.float32).T - scores).abs().mean().item()

    plain = score_error(queries, keys)
    rotated = score_error(rotate_keys(queries), rotate_keys(keys))
    assert rotated < plain / 2, (plain, rotated)

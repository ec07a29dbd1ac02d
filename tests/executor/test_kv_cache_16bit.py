"""A 16-bit KV cache under float32 activations (`--kv-cache-dtype float16|bfloat16`): the C
kernel writes the decode step's keys and values as torch rounds them, bit for bit; attention
over the cache, the C kernel against the torch backend and naive attention over the rounded
values (decodes, prefills, chunked prefills, GQA, sliding window); the cache holds twice the
tokens of a float32 one; the refusals. The whole-stack decode step over it:
test_decode_kernel.py; its fidelity: test_fidelity.py."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend
from pagoda.executor.attention.torch_backend import write_kv_cache
from pagoda.executor.kernels.ops import paged_attention
from pagoda.executor.kv_cache_allocation import allocate_kv_caches, determine_num_blocks
from tests.executor.test_kv_cache_quant import STEPS, fake_runner, reference_over, step_on_cache

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SMOLLM_HEADS = (9, 3, 64)


def bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.int16)


@pytest.mark.parametrize("name", DTYPES)
def test_the_kernel_rounds_new_keys_as_torch_does_bit_for_bit(name) -> None:
    """The decode step's K/V written by the C kernel (new_keys) against write_kv_cache:
    values halfway between two neighbours (ties to even), signed zeros, subnormals, values
    past the format's largest (float16: infinity), rows from 1e-30 to 1e6."""
    torch.manual_seed(2)
    dtype, dim = DTYPES[name], 64
    below = torch.randn(4096).abs().to(dtype)
    above = (below.view(torch.int16) + 1).view(dtype)  # the next value of the format
    midpoints = (below.float() + above.float()) / 2  # exact in float32: a tie either way
    signs = torch.where(torch.rand(4096) < 0.5, -1.0, 1.0)
    ties = (signs * midpoints).view(-1, dim)
    assert not torch.equal(ties.to(dtype).float(), ties)  # they round
    spread = torch.randn(64, dim) * torch.logspace(-30, 6, 64)[:, None]
    special = torch.tensor([0.0, -0.0, 6.0e-8, -3.0e-5, 65504.0, 65520.0, 7.0e4, -1.0e5] * 8)
    rows = torch.cat([ties, spread, special.view(1, dim), torch.zeros(1, dim)])
    n, block_size = len(rows), 16
    num_blocks = -(-n // block_size)
    shape = (2, 1, num_blocks, block_size, dim)
    cache, expected = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:n]
    key, value = rows.view(n, 1, dim), rows.flip(0).contiguous().view(n, 1, dim)
    write_kv_cache(key, value, expected, slots)
    paged_attention(torch.randn(n, 1, dim), cache, (slots // block_size).view(n, 1),
                    torch.arange(n), slots % block_size + 1, dim**-0.5, None,
                    new_keys=(key, value, slots))
    assert torch.equal(bits(cache), bits(expected))
    assert expected.float().abs().max() > 0  # the rows were written at all


def sixteen_bit_step(seqs, name, heads, block_size=16, num_blocks=64, window=None, seed=0):
    """One step (test_kv_cache_quant.step_on_cache) on a 16-bit cache whose other slots hold
    stale values: (torch backend output, cache after it), (kernel backend output, cache
    after it), and naive attention over the rounded values."""
    _, num_kv_heads, head_dim = heads
    dtype = DTYPES[name]
    stale = torch.randn((2, num_kv_heads, num_blocks, block_size, head_dim),
                        generator=torch.Generator().manual_seed(seed + 1))
    results, full_k, full_v, q, scheduled = step_on_cache(
        stale.to(dtype), torch.clone, seqs, heads, block_size, num_blocks, window, seed)
    expected = reference_over(q, scheduled, [k.to(dtype).float() for k in full_k],
                              [v.to(dtype).float() for v in full_v], seqs, window)
    return results[0], results[1], expected


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("heads", [SMOLLM_HEADS, (32, 8, 64), (4, 4, 32), (8, 1, 128)])
def test_kernel_attention_on_a_16_bit_cache_matches_the_torch_backend(name, seqs, heads) -> None:
    (torch_out, torch_cache), (kernel_out, kernel_cache), expected = sixteen_bit_step(
        seqs, name, heads)
    assert torch.equal(bits(torch_cache), bits(kernel_cache))
    torch.testing.assert_close(torch_out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", DTYPES)
def test_16_bit_attention_sliding_window(name) -> None:
    (torch_out, torch_cache), (kernel_out, kernel_cache), expected = sixteen_bit_step(
        [(50, 1), (9, 1), (2, 9)], name, SMOLLM_HEADS, window=20, seed=3)
    assert torch.equal(bits(torch_cache), bits(kernel_cache))
    torch.testing.assert_close(torch_out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)


def test_a_deep_context_reads_every_key() -> None:
    """4,100 keys over blocks in a shuffled order (the kernel reads a block ahead): the one
    key that carries the answer is found wherever it sits."""
    torch.manual_seed(5)
    num_kv_heads, head_dim, block_size, length = 2, 64, 16, 4100
    num_blocks = -(-length // block_size) + 3
    table = torch.randperm(num_blocks)[: -(-length // block_size)].view(1, -1)
    for needle in (0, 15, 16, 2049, length - 1):
        cache = torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim, dtype=torch.float16)
        slot = table[0, needle // block_size] * block_size + needle % block_size
        cache[0].view(num_kv_heads, -1, head_dim)[:, slot] = 8.0  # the only key that matches
        cache[1].view(num_kv_heads, -1, head_dim)[:, slot] = 1.0  # and its value
        query = torch.ones(1, 2 * num_kv_heads, head_dim)
        out = paged_attention(query, cache, table, torch.zeros(1, dtype=torch.long),
                              torch.tensor([length]), head_dim**-0.5, None)
        torch.testing.assert_close(out, torch.ones_like(out), atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", DTYPES)
def test_the_same_memory_holds_twice_the_tokens_of_float32(name) -> None:
    memory, scheduler = 64 << 20, SchedulerConfig(max_num_seqs=1024)
    half = fake_runner(torch.float32, name, memory)
    full = fake_runner(torch.float32, "auto", memory)
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert determine_num_blocks(half, 8192, scheduler) >= 2 * determine_num_blocks(full, 8192, scheduler) - 1
    caches = allocate_kv_caches(half.backend.kv_cache_shape(8, 3, 64), 2, torch.float32,
                                torch.device("cpu"), name)
    assert caches[0].dtype == DTYPES[name] and caches[0].shape == (2, 3, 8, 16, 64)
    assert isinstance(half.backend, CpuKernelAttentionBackend)


def test_the_refusals_name_the_problem() -> None:
    from pagoda.executor.model_runner import ModelRunner

    with pytest.raises(ValueError, match="float16 needs float32 activations"):
        fake_runner(torch.bfloat16, "float16", 1 << 20)
    # bfloat16 activations keep a bfloat16 cache already: the same as auto
    assert fake_runner(torch.bfloat16, "bfloat16", 1 << 20).kv_bytes_per_token == (
        fake_runner(torch.bfloat16, "auto", 1 << 20).kv_bytes_per_token)
    runner = fake_runner(torch.float32, "float16", 1 << 20)
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner(runner.model, torch.device("meta"), torch.float32,
                    CacheConfig(kv_cache_dtype="float16"), [])
    with pytest.raises(ValueError, match="float32 queries"):
        paged_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                        torch.zeros(2, 1, 2, 16, 64, dtype=torch.float16),
                        torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                        torch.ones(1, dtype=torch.long), 0.125, None)

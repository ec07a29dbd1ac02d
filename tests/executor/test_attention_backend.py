"""The torch attention backend against naive per-sequence attention, on a paged cache with
scattered blocks, stale values in unused rows, and mixed decode / prefill / chunked steps;
layers with their own window and soft-capping (Gemma) or sinks (gpt-oss) on one step's
metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.executor.attention.torch_backend import TorchAttentionBackend, write_kv_cache

BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 48, 6, 2, 8


def reference_attention(q, keys, values, first_pos, window, softcap=None, sinks=None):
    """q (Q, H, D) at positions first_pos.., keys/values (seq_len, Hkv, D) -> (Q, H, D),
    in float32; `sinks` (H,): each head's extra softmax column, dropped after it."""
    q, keys, values = q.float(), keys.float(), values.float()
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # (L, H, D)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(q.shape[0])[:, None] + first_pos
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hql,lhd->qhd", probs, v)


def run_step(seqs, window=None, seed=0, backend_class=TorchAttentionBackend,
             dtype=torch.float32, heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), block_size=BLOCK_SIZE,
             num_blocks=NUM_BLOCKS, layers=None):
    """seqs: (num_computed, num_scheduled) per sequence. Returns (backend output, reference);
    heads: (query heads, KV heads, head dim). `layers`: (window, softcap[, sinks]) of each
    layer called on the step's one metadata (window None: the backend's); returns a list of
    pairs then."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    backend = backend_class(block_size, torch.device("cpu"), window)
    shape = backend.kv_cache_shape(num_blocks, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)  # stale, finite values everywhere
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    free = rng.permutation(num_blocks)
    tables, start = np.zeros((len(seqs), max(blocks_needed)), dtype=np.int64), 0
    for i, count in enumerate(blocks_needed):
        tables[i, :count] = free[start : start + count]
        start += count
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in seqs]
    for i, (computed, _) in enumerate(seqs):  # earlier steps' K/V already in the cache
        pos = np.arange(computed)
        slots = torch.from_numpy(tables[i, pos // block_size] * block_size + pos % block_size)
        write_kv_cache(full_k[i][:computed], full_v[i][:computed], kv_cache, slots)

    computed = np.array([c for c, _ in seqs])
    scheduled = np.array([n for _, n in seqs])
    metadata = backend.build_metadata(computed, scheduled, tables)
    q = torch.randn(int(scheduled.sum()), num_heads, head_dim, generator=gen).to(dtype)
    k = torch.cat([full_k[i][c:] for i, (c, _) in enumerate(seqs)])
    v = torch.cat([full_v[i][c:] for i, (c, _) in enumerate(seqs)])
    results = []
    for layer_window, softcap, *sinks in layers or [(None, None)]:
        sinks = sinks[0] if sinks else None
        out = backend.forward(q, k, v, kv_cache, metadata, head_dim**-0.5,
                              window=layer_window, softcap=softcap, sinks=sinks)
        expected = torch.cat([
            reference_attention(q_rows, full_k[i], full_v[i], seqs[i][0],
                                window if layer_window is None else layer_window, softcap,
                                sinks)
            for i, q_rows in enumerate(q.split(scheduled.tolist()))
        ])
        results.append((out, expected))
    return results if layers else results[0]


@pytest.mark.parametrize(
    "seqs",
    [
        [(7, 1), (0, 1), (12, 1), (3, 1)],  # decodes only (the whole-batch fast path)
        [(0, 5), (7, 1), (3, 6), (12, 1), (0, 1)],  # prefill, chunk after a prefix, decodes
        [(0, 9), (4, 4)],  # prefills only
        [(0, 9), (0, 4), (0, 16), (0, 1)],  # prompts from position 0: plain causal, padded
        [(20, 1), (0, 17), (16, 3)],
    ],
)
def test_matches_naive_attention(seqs) -> None:
    out, expected = run_step(seqs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prompts_from_position_zero_need_no_mask() -> None:
    """Such a prefill group runs SDPA's is_causal (no mask built, the masked half skipped);
    a cached prefix or a sliding window brings the mask back."""
    backend = TorchAttentionBackend(BLOCK_SIZE, torch.device("cpu"))
    backend.kv_cache_shape(NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM)
    tables = np.arange(6, dtype=np.int64).reshape(2, 3)

    def prefill_mask(computed, scheduled, window_backend=backend):
        metadata = window_backend.build_metadata(np.array(computed), np.array(scheduled), tables)
        (group,) = metadata.backend_data
        return group.mask

    assert prefill_mask([0, 0], [9, 4]) is None
    assert prefill_mask([0, 3], [9, 4]) is not None
    windowed = TorchAttentionBackend(BLOCK_SIZE, torch.device("cpu"), sliding_window=4)
    windowed.kv_cache_shape(NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM)
    assert prefill_mask([0, 0], [9, 4], windowed) is not None


def test_sliding_window() -> None:
    out, expected = run_step([(13, 1), (2, 9), (9, 1)], window=5, seed=3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cache_layout_is_one_tile_per_head_and_block() -> None:
    backend = TorchAttentionBackend(BLOCK_SIZE, torch.device("cpu"))
    kv_cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM))
    key = torch.arange(2 * NUM_KV_HEADS * HEAD_DIM, dtype=torch.float32).view(2, NUM_KV_HEADS, -1)
    # token 0 -> block 5 row 1, token 1 -> block 2 row 3
    write_kv_cache(key, -key, kv_cache, torch.tensor([5 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 3]))
    for head in range(NUM_KV_HEADS):
        assert torch.equal(kv_cache[0, head, 5, 1], key[0, head])
        assert torch.equal(kv_cache[1, head, 2, 3], -key[1, head])
    assert int((kv_cache != 0).any(-1).sum()) == 2 * 2 * NUM_KV_HEADS


@pytest.mark.parametrize(
    "seqs",
    [
        [(13, 1), (0, 1), (6, 1)],  # decodes only
        [(13, 1), (2, 9), (0, 12), (9, 1)],  # decodes, a chunk after a prefix, a prompt
        [(0, 9), (0, 4)],  # prompts from position 0 (no is_causal shortcut when windowed)
    ],
)
def test_layers_bring_their_own_window_and_softcap(seqs) -> None:
    """Gemma's interleaved layers on one step's metadata: global, sliding (window 5),
    soft-capped global and soft-capped sliding (Gemma 2), each against naive attention; the
    backend has no window of its own."""
    layers = [(None, None), (5, None), (None, 2.0), (5, 2.0), (None, None)]
    for (out, expected), layer in zip(run_step(seqs, seed=4, layers=layers), layers):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")


def test_softcap_bends_the_scores() -> None:
    """The soft-capped result differs from the plain one (the test above would catch a cap
    that is ignored only if it mattered): scores of randn queries reach past a cap of 1."""
    (plain, _), (capped, _) = run_step([(2, 9), (9, 1)], seed=5,
                                       layers=[(None, None), (None, 1.0)])
    assert (plain - capped).abs().max() > 1e-2


def test_softcapped_prefill_takes_query_rows_in_slices(monkeypatch) -> None:
    from pagoda.executor.attention import torch_backend

    monkeypatch.setattr(torch_backend, "EXPLICIT_SCORES_PER_SLICE", 64)  # a few rows a slice
    (out, expected), = run_step([(3, 17), (0, 11)], seed=6, layers=[(4, 2.0)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


SINKS = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0, 1.0])  # (NUM_HEADS,): some outweigh the scores


@pytest.mark.parametrize(
    "seqs",
    [
        [(13, 1), (0, 1), (6, 1)],  # decodes only
        [(13, 1), (2, 9), (0, 12), (9, 1)],  # decodes, a chunk after a prefix, a prompt
        [(0, 9), (0, 4)],  # prompts from position 0 (explicit, never is_causal)
    ],
)
def test_sinks_take_their_share_of_each_row(seqs) -> None:
    """gpt-oss's layers: global and sliding (window 5) with per-head sinks, beside a plain
    and a soft-capped one, each against naive attention with the sink column; and the sinks
    change the result (a sink that is ignored would fail here)."""
    layers = [(None, None, SINKS), (5, None, SINKS), (None, None), (5, 2.0, SINKS)]
    results = run_step(seqs, seed=7, layers=layers)
    for (out, expected), layer in zip(results, layers):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"layer {layer[:2]}")
    (with_sinks, _), _, (plain, _), _ = results
    assert (with_sinks - plain).abs().max() > 1e-2

"""Torch-facing wrappers of the C kernels in cpu_kernels.c.

`gemm_q` has a custom op twin (`pagoda::gemm_q`) for torch.compile graphs, which treat it as
opaque; the attention kernel is called from inside the `pagoda::attention` op, which already
is."""

from __future__ import annotations

import torch

from pagoda.executor.kernels.build import load_cpu_kernels
from pagoda.executor.kernels.packing import FORMATS


def kernels_available() -> bool:
    return load_cpu_kernels() is not None


def gemm_q(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    format: str, out_features: int,
) -> torch.Tensor:
    """x (M, K) bf16 contiguous, weight packed by packing.pack -> (M, out_features) bf16.
    A direct call (an op through the dispatcher costs 3-11 us more per call); under
    torch.compile call `gemm_q_op`, which the graph treats as opaque."""
    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError("gemm_q needs Pagoda's CPU kernels, unavailable here")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"gemm_q takes a contiguous 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    rows, in_features = x.shape
    y = x.new_empty(rows, out_features)
    lib.pagoda_gemm_q(
        FORMATS[format], x.data_ptr(), rows, in_features, out_features, codes.data_ptr(),
        scales.data_ptr(), None if mins is None else mins.data_ptr(), y.data_ptr(),
    )
    return y


# The graph-facing op, declared through the low-level torch.library API: a call costs ~7 us
# against ~9.5 us through torch.library.custom_op, whose per-call checks add up over ~120
# matmuls a step.
_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("gemm_q(Tensor x, Tensor codes, Tensor scales, Tensor? mins, str format, "
                "int out_features) -> Tensor")
_library.impl("gemm_q", gemm_q, "CPU")
gemm_q_op = torch.ops.pagoda.gemm_q


@torch.library.register_fake("pagoda::gemm_q")
def _(x, codes, scales, mins, format, out_features):
    return x.new_empty(x.shape[0], out_features)


MAX_QUERIES_PER_KV_HEAD = 16
"""MAX_GROUP and MAX_HEAD_DIM of cpu_kernels.c"""
MAX_HEAD_DIM = 256


def paged_attention_supported(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether paged_attention takes this layer's shapes (else use the torch path)."""
    return (
        kernels_available() and dtype == torch.bfloat16 and head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_QUERIES_PER_KV_HEAD
    )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_seq: torch.Tensor, key_lens: torch.Tensor, scale: float, window: int | None,
    new_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each query token against the first key_lens[t] keys (its position + 1) of sequence
    query_seq[t] in the paged cache; only the last `window` of them when window is set.
    query (T, H, D) bf16; kv_cache (2, Hkv, blocks, block_size, D) bf16; block_tables
    (S, width), query_seq and key_lens (T,) int64 -> (T, H, D) bf16.

    The cache already holds this step's keys, or `new_keys` = (key, value, slots) brings them:
    key/value (T, Hkv, D) bf16, slots (T,) int64 flat cache slots, written by the kernel as it
    goes (one call instead of two index_copy_ and one attention). Only for decode tokens: each
    query token must be the only new token of its sequence."""
    lib = load_cpu_kernels()
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    query = query.contiguous()
    out = torch.empty_like(query)
    new_k = new_v = slots = None
    k_stride = v_stride = 0
    if new_keys is not None:
        # named, not temporaries: each must outlive the call that reads its pointer
        key, value = _token_rows(new_keys[0]), _token_rows(new_keys[1])
        slot_mapping = new_keys[2].to(torch.int64).contiguous()
        new_k, new_v, slots = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
        k_stride, v_stride = key.stride(0), value.stride(0)
    lib.pagoda_paged_attention(
        query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), query_seq.data_ptr(),
        key_lens.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, num_blocks,
        block_size, block_tables.shape[1], window or 0, scale, new_k, new_v, k_stride, v_stride,
        slots, out.data_ptr(),
    )
    return out


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """(T, Hkv, D) -> itself when each token's (Hkv, D) values are contiguous (tokens at any
    stride, as in a view of the fused qkv output), else a contiguous copy."""
    heads_packed = t.shape[1] == 1 or t.stride(1) == t.shape[2]
    return t if t.stride(2) == 1 and heads_packed else t.contiguous()

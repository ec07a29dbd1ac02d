"""Torch-facing wrappers of the C kernels in csrc/ (kernels.h lists them).

Each kernel comes in the two activation dtypes the library builds: bfloat16 (avx512_bf16.c,
CPUs with AVX-512 BF16) and float32 (gemm_f32.c and attention_f32.c, every CPU); the input's dtype picks.
`gemm_q` has a custom op twin (`pagoda::gemm_q`) for torch.compile graphs, which treat it as
opaque; the attention kernel is called from inside the `pagoda::attention` op, which already
is."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagoda.executor.kernels.abi import AttentionArgs, kv_cache_format, weight_format
from pagoda.executor.kernels.build import load_cpu_kernels
from pagoda.executor.kernels.kv_cache_types import SIXTEEN_BIT, QuantizedKVCache
from pagoda.executor.kernels.packing import TILE_N

KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def kernels_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether Pagoda's kernels run `dtype` activations on this CPU."""
    lib = load_cpu_kernels()
    if lib is None or dtype not in KERNEL_DTYPES:
        return False
    return dtype == torch.float32 or bool(lib.pagoda_bf16_kernels_available())


def _kernel(name: str, dtype: torch.dtype):
    if not kernels_available(dtype):
        raise RuntimeError(f"Pagoda's {name} kernel does not run {dtype} on this CPU")
    return getattr(load_cpu_kernels(), f"pagoda_{name}_{KERNEL_DTYPES[dtype]}")


def gemm_q(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    format: str, out_features: int, rowwise: bool = False,
) -> torch.Tensor:
    """x (M, K) bf16 or float32 contiguous, weight packed by packing.pack -> (M, out_features)
    in x's dtype. A direct call (an op through the dispatcher costs 3-11 us more per call);
    under torch.compile call `gemm_q_op`, which the graph treats as opaque. `rowwise`
    (float32 only): batch-invariant, as packed_weight.gemm_packed's."""
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"gemm_q takes a contiguous 2-D bfloat16 or float32 input, got "
                         f"{x.dtype} {tuple(x.shape)}")
    kernel = _kernel("gemm_q", x.dtype)
    rows, in_features = x.shape
    if rowwise and x.dtype != torch.float32:
        raise ValueError(f"the row-wise gemm_q takes float32 rows, got {x.dtype}")
    if x.dtype == torch.float32 and rows >= DEQUANTIZE_FROM_ROWS and not rowwise:
        return _dequantized_matmul(x, codes, scales, mins, format, out_features)
    y = x.new_empty(rows, out_features)
    if rowwise:  # the Q4 / Q8 planes are (codes, scales, mins) of the any-format entry
        load_cpu_kernels().pagoda_gemm_packed_rowwise_f32(
            weight_format(format), x.data_ptr(), rows, in_features, out_features, codes.data_ptr(),
            None, scales.data_ptr(), None if mins is None else mins.data_ptr(), None, None,
            y.data_ptr())
        return y
    kernel(weight_format(format), x.data_ptr(), rows, in_features, out_features, codes.data_ptr(),
           scales.data_ptr(), None if mins is None else mins.data_ptr(), y.data_ptr())
    return y


DEQUANTIZE_FROM_ROWS = 128
"""From this many float32 rows gemm_q dequantizes the weight, a slice of outputs at a time,
and multiplies with torch's BLAS matmul (prefills): the kernel decodes every weight once per
4 rows, so it falls behind a BLAS matmul by a little once the one-off dequantization (4
bytes written a weight) is amortized (the crossover is measured in BENCHMARKS.md)."""
DEQUANTIZE_SLICE_BYTES = 8 << 20
"""Float32 weight bytes dequantized at once (a cache-sized slice of W^T, reused per call)."""


def _dequantized_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    format: str, out_features: int,
) -> torch.Tensor:
    """x (M, K) float32 @ W^T -> (M, out_features), W (packing.pack's planes) dequantized
    slice by slice of outputs."""
    in_features = x.shape[1]
    tiles = out_features // TILE_N
    flat_codes, flat_scales = codes.view(tiles, -1), scales.view(tiles, -1)
    flat_mins = None if mins is None else mins.view(tiles, -1)

    def dequantize_slice(start: int, stop: int) -> torch.Tensor:
        first, last = start // TILE_N, stop // TILE_N
        return dequantize_transposed(
            flat_codes[first:last], flat_scales[first:last],
            None if flat_mins is None else flat_mins[first:last], format, stop - start,
            in_features)

    return dequantized_matmul(x, out_features, dequantize_slice)


def dequantized_matmul(
    x: torch.Tensor, out_features: int, dequantize_slice: Callable[[int, int], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x (M, K) float32 @ W^T -> (M, out_features) float32, where dequantize_slice(start,
    stop) gives W^T's columns start .. stop - 1 (K, stop - start) in `dtype`: a cache-sized
    slice of whole 16-output tiles at a time (DEQUANTIZE_SLICE_BYTES of float32), each
    multiplied by torch's matmul into its columns of the output. dtype bfloat16: x is rounded
    to bf16 once, each slice's product comes out of oneDNN in bf16 (float32 sums rounded
    once) and the whole result is widened to float32."""
    in_features = x.shape[1]
    slice_outputs = max(TILE_N, DEQUANTIZE_SLICE_BYTES // (4 * in_features) // TILE_N * TILE_N)
    rows = x.to(dtype)
    if slice_outputs >= out_features:
        return (rows @ dequantize_slice(0, out_features)).float()
    y = rows.new_empty(x.shape[0], out_features)
    for start in range(0, out_features, slice_outputs):
        stop = min(start + slice_outputs, out_features)
        torch.mm(rows, dequantize_slice(start, stop), out=y[:, start:stop])
    return y.float()


def dequantize_transposed(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, format: str,
    out_features: int, in_features: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The packed weight as float32 W^T (in_features, out_features), for x @ W^T by a BLAS
    matmul; written into `out` when given (reused across calls)."""
    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError("dequantize_transposed needs Pagoda's CPU kernels, unavailable here")
    if out is None:
        out = torch.empty(in_features, out_features)
    lib.pagoda_dequantize_q_f32(weight_format(format), in_features, out_features, codes.data_ptr(),
                                scales.data_ptr(), None if mins is None else mins.data_ptr(),
                                out.data_ptr())
    return out


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
"""MAX_GROUP and MAX_HEAD_DIM of csrc/kernels.h"""
MAX_HEAD_DIM = 256


def paged_attention_supported(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether paged_attention takes this layer's shapes (else use the torch path)."""
    return (
        kernels_available(dtype) and head_dim % 32 == 0
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
    query (T, H, D); kv_cache (2, Hkv, blocks, block_size, D), both bf16 or both float32;
    block_tables (S, width), query_seq and key_lens (T,) int64 -> (T, H, D).

    The cache already holds this step's keys, or `new_keys` = (key, value, slots) brings them:
    key/value (T, Hkv, D), slots (T,) int64 flat cache slots, written by the kernel as it
    goes (one call instead of two index_copy_ and one attention). Only for decode tokens: each
    query token must be the only new token of its sequence.

    kv_cache may be an 8-bit QuantizedKVCache (kernels/kv_cache_types.py), with float32 queries:
    the kernel decodes codes and scales as it reads, and quantizes `new_keys` as it writes.
    Or a float16 / bfloat16 cache under float32 queries (--kv-cache-dtype float16|bfloat16):
    widened as it is read, `new_keys` rounded to nearest even as they are written."""
    quantized = isinstance(kv_cache, QuantizedKVCache)
    narrow = not quantized and kv_cache.dtype != query.dtype  # a 16-bit cache, float32 queries
    if quantized or narrow:
        if query.dtype != torch.float32 or narrow and kv_cache.dtype not in SIXTEEN_BIT_CACHES:
            raise ValueError(f"a {kv_cache_dtype_name(kv_cache)} KV cache's kernel takes "
                             f"float32 queries, got {query.dtype}")
        kernels = load_cpu_kernels()
        kernel = kernels.pagoda_paged_attention_q8_f32 if quantized else (
            kernels.pagoda_paged_attention_h16_f32)
    else:
        kernel = _kernel("paged_attention", query.dtype)
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    query = query.contiguous()
    out = torch.empty_like(query)
    args = AttentionArgs(
        query=query.data_ptr(), block_tables=block_tables.data_ptr(),
        query_seq=query_seq.data_ptr(), key_lens=key_lens.data_ptr(), out=out.data_ptr(),
        num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, num_blocks=num_blocks, block_size=block_size,
        table_width=block_tables.shape[1], window=window or 0, scale=scale)
    if quantized:
        args.kv_cache, args.kv_scales = kv_cache.codes.data_ptr(), kv_cache.scales.data_ptr()
    else:
        args.kv_cache = kv_cache.data_ptr()
    if quantized or narrow:
        args.kv_format = kv_cache_format(kv_cache_dtype_name(kv_cache))
    if new_keys is not None:
        # named, not temporaries: each must outlive the call that reads its pointer
        key, value = _token_rows(new_keys[0]), _token_rows(new_keys[1])
        slot_mapping = new_keys[2].to(torch.int64).contiguous()
        args.new_k, args.new_v, args.slots = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
        args.k_stride, args.v_stride = key.stride(0), value.stride(0)
    kernel(ctypes.byref(args))
    return out


SIXTEEN_BIT_CACHES = {dtype: name for name, dtype in SIXTEEN_BIT.items()}


def kv_cache_dtype_name(kv_cache: torch.Tensor | QuantizedKVCache) -> str:
    """The --kv-cache-dtype a cache was allocated for (an 8-bit one's, or its torch dtype's)."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.kv_cache_dtype
    return SIXTEEN_BIT_CACHES.get(kv_cache.dtype, str(kv_cache.dtype).removeprefix("torch."))


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """(T, Hkv, D) -> itself when each token's (Hkv, D) values are contiguous (tokens at any
    stride, as in a view of the fused qkv output), else a contiguous copy."""
    heads_packed = t.shape[1] == 1 or t.stride(1) == t.shape[2]
    return t if t.stride(2) == 1 and heads_packed else t.contiguous()


RMS_NORM_KERNEL_MAX_ROWS = 64
"""Up to this many float32 rows RMSNorm takes the C kernel (one thread, no dispatch);
torch's rms_norm is as fast from there on."""


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (M, 2I) float32 contiguous, rows [gate | up] -> silu(gate) * up (M, I), each
    row computed alike whatever M (torch's elementwise loops take a scalar path for the tail
    of a range, whose silu rounds differently from the vector body's)."""
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    load_cpu_kernels().pagoda_silu_and_mul_f32(gate_up.data_ptr(), rows, width // 2,
                                               out.data_ptr())
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual (M, H) float32 contiguous; weight (H,) -> (norm(x + residual) * weight,
    x + residual or None without a residual)."""
    out = torch.empty_like(x)
    new_residual = None if residual is None else torch.empty_like(x)
    load_cpu_kernels().pagoda_rms_norm_f32(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        eps, x.shape[0], x.shape[1], out.data_ptr(),
        None if new_residual is None else new_residual.data_ptr())
    return out, new_residual

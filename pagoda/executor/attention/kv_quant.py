"""The 8-bit KV cache (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`): codes plus one scale per
(token, KV head), quantized as K/V are written, dequantized as they are read.

Layout of one layer, the float cache's shape with codes in place of values:

    codes   (2, num_kv_heads, num_blocks, block_size, head_dim)  int8 (int8) or uint8 (fp8 bits)
    scales  (2, num_kv_heads, num_blocks, block_size)            bfloat16

    value = decode(code) * scale,   scale = amax(|row|) / QMAX rounded *up* to bfloat16

One scale a head_dim-long row (64 values for SmolLM2): 2 bytes against 64 code bytes, so the
cache holds 1.94x the tokens of a 16-bit one (3.88x of float32) in the same bytes; llama.cpp's
q8_0 (one float16 scale per 32 values) would give 1.88x. A scale per row is also what a token
written at a time needs (no block-wide scale to rescale when a later token is larger).
bfloat16, not float16, for the scale: float32's range (a row of tiny values keeps its
precision; fp8_e5m2's amax / 57344 would be subnormal in float16) and the C kernel widens it
with one shift. Rounding the scale up keeps every |value| / scale <= QMAX, so nothing clips.

Quantizing is bit-for-bit the same in torch (here) and in the C kernel (attention_f32.c,
`quantize_row`): float32 division by the scale, round half to even (int8), or the
round-to-nearest-even float8 conversion torch does.

Keys are stored rotated. A few channels of a key carry most of its magnitude, so one scale
a row leaves the others few levels: nearly all of the quantized cache's error is in the
keys (measured in BENCHMARKS.md). The attention layer multiplies queries and keys by the same
orthogonal matrix R (`key_rotation`: a normalized Hadamard matrix where head_dim is a power
of two), which leaves every score q.k = (qR).(kR) unchanged and spreads the outlier
channels over all of them, which lowers the quantized cache's KL against float32.
"""

from __future__ import annotations

import functools

import torch

from pagoda.config import KV_CACHE_ALIASES, KV_CACHE_DTYPES  # noqa: F401  (re-exported)

# The cache types live below the kernels (kernels/kv_cache_types.py); re-exported here, the
# home of the 8-bit cache's arithmetic, for the backends, the runner and the KV tiers.
from pagoda.executor.kernels.kv_cache_types import SIXTEEN_BIT, QuantizedKVCache  # noqa: F401

FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
"""Largest code magnitude: int8 is symmetric (-127 .. 127, never -128); fp8: the format's
largest finite value."""
SCALE_BYTES = 2
SMALLEST_SCALE_BITS = 0x0080
"""bfloat16 2^-126 (smallest normal): the scale of an all-zero row (codes 0)."""


@functools.cache
def key_rotation(head_dim: int) -> torch.Tensor:
    """(head_dim, head_dim) float32 orthogonal R that queries and keys are multiplied by
    before a quantized cache: Sylvester's Hadamard matrix / sqrt(head_dim) for a power of
    two, else a fixed (seeded) random orthogonal matrix."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return h / head_dim**0.5
    generator = torch.Generator().manual_seed(head_dim)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate_keys(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) queries or keys -> x @ key_rotation(head_dim), in x's dtype."""
    return x @ key_rotation(x.shape[-1]).to(device=x.device, dtype=x.dtype)


def unrotate_keys(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) rotated by rotate_keys -> x @ R^T: back where it was (R is
    orthogonal). For outputs whose values were read from rotated keys."""
    return x @ key_rotation(x.shape[-1]).t().to(device=x.device, dtype=x.dtype)


def canonical_kv_cache_dtype(name: str) -> str:
    return KV_CACHE_ALIASES.get(name, name)


def is_quantized(kv_cache_dtype: str) -> bool:
    """An 8-bit cache: codes and scales (QuantizedKVCache)."""
    return canonical_kv_cache_dtype(kv_cache_dtype) in QMAX


def plain_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache that is not 8-bit: the 16-bit one named, else `dtype`
    (the activations')."""
    return SIXTEEN_BIT.get(kv_cache_dtype, dtype)


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError naming the problem where this cache cannot run with these activations on
    this device: every cache but the activations' own has CPU kernels only, and a 16-bit one
    is read by the float32 kernel (bfloat16 activations already keep a bfloat16 cache)."""
    own = kv_cache_dtype == "auto" or SIXTEEN_BIT.get(kv_cache_dtype) == dtype
    if own:
        return
    if device.type != "cpu":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} runs on CPU only for now; use "
                         f"--kv-cache-dtype auto on {device.type}")
    if kv_cache_dtype in SIXTEEN_BIT and dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs float32 activations "
                         f"(--dtype float32); with {str(dtype).removeprefix('torch.')} ones use "
                         f"--kv-cache-dtype auto")


def code_dtype(kv_cache_dtype: str) -> torch.dtype:
    """Storage dtype of the codes: int8, or uint8 holding float8 bits (index_put_ and
    index_select run on every device for those, not always for float8 dtypes)."""
    return torch.int8 if kv_cache_dtype == "int8" else torch.uint8


def bytes_per_token_head(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes one token's K (or V) row of one KV head takes: codes and its scale."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> codes (..., D) in code_dtype, scales (...) bfloat16: one scale per
    row of D values."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # The scale amax / QMAX rounded up to bfloat16 (by its float32 bits; positive, finite).
    bits = (amax / QMAX[kv_cache_dtype]).view(torch.int32)
    scale_bits = ((bits + 0xFFFF) >> 16).clamp_min(SMALLEST_SCALE_BITS)
    scales = scale_bits.to(torch.int16).view(torch.bfloat16)
    y = x / scales.float()[..., None]
    if kv_cache_dtype == "int8":
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        qmax = QMAX[kv_cache_dtype]
        codes = y.clamp_(-qmax, qmax).to(FLOAT8[kv_cache_dtype]).view(torch.uint8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str,
               dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D), scales (...) -> values (..., D) in `dtype` (computed in float32)."""
    values = codes.float() if kv_cache_dtype == "int8" else (
        codes.view(FLOAT8[kv_cache_dtype]).float())
    return values.mul_(scales.float()[..., None]).to(dtype)

"""GGUF (llama.cpp) dequantization in torch.

`dequantize_tensor` turns one tensor as `gguf.GGUFReader` hands it over (a numpy view into
the memory-mapped file) into a dense torch tensor. Every quantized format is decoded with
vectorised torch ops over all blocks of the tensor at once: no Python loop over blocks.

The spec is `gguf/quants.py` of the `gguf` package (itself a port of ggml-quants.c); the
tests compare against it bit for bit. Each decoder below starts with its block's byte map.
All multi-byte fields are little-endian; `d`/`dmin`/`m` are IEEE float16.

Element order: a row of the logical tensor is split into consecutive blocks of `block_size`
elements, so decoding the blocks in file order and reshaping to the row-major `shape`
(reversed GGUF `ne`) gives the right layout.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K  # 256 elements per k-quant super-block

REFERENCE_DECODED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {Q.Q2_K, Q.Q3_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
     Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4}
)
"""Types decoded by the spec itself (`gguf.quants.dequantize`, numpy, vectorised over
blocks: ~10 ms per million weights): the lower-bit K-quants, the i-quants with their grids,
the ternary types, MXFP4 and NVFP4. (Q1_0, which gguf.quants cannot decode yet, is
refused.) The packed path re-encodes Q3_K, IQ3_S, TQ2_0, IQ4_NL and MXFP4 exactly as Q6_K or
Q8_0 (gguf_exact_repacking.py) and requantizes the rest to Q8_0 (gguf_packing.py)."""
SUPPORTED_GGUF_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
) | REFERENCE_DECODED_TYPES


# ---------------------------------------------------------------------------------------
# Byte-field helpers. `blocks` is always (num_blocks, type_size) uint8.


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32. -> (num_blocks, 1)"""
    # .contiguous(): a column slice's row stride is type_size, which need not be even.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2, k): low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def bits(qh: torch.Tensor, num_bits: int, width: int = 1) -> torch.Tensor:
    """(..., k) bytes -> (..., num_bits // width, k): field j is `(byte >> j*width) & mask`."""
    shifts = torch.arange(0, num_bits, width, dtype=torch.uint8, device=qh.device)
    mask = (1 << width) - 1
    return (qh.unsqueeze(-2) >> shifts.view(-1, 1)) & mask


def qh_bit_per_element(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32): element j gets bit j."""
    # bit j of the uint32 is bit j % 8 of byte j // 8: (n, 4 bytes, 8 bits) -> (n, 32)
    return bits(qh, 8).transpose(-1, -2).reshape(qh.shape[0], 32)


# ---------------------------------------------------------------------------------------
# Legacy 32-element blocks. Within a block of packed nibbles, qs[i] holds element i in its
# low nibble and element i + 16 in its high nibble.


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # 34 bytes: [0:2) d f16 | [2:34) qs int8 x32          x = d * q
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes: [0:2) d f16 | [2:18) qs 4-bit x32         x = d * (q - 8)
    d = _f16(blocks, 0)
    q = nibbles(blocks[:, 2:]).reshape(-1, 32).float()
    return d * (q - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # 20 bytes: [0:2) d f16 | [2:4) m f16 | [4:20) qs 4-bit x32      x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = nibbles(blocks[:, 4:]).reshape(-1, 32).float()
    return d * q + m


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values (n, 32) as float32: low nibble from qs, fifth bit from qh."""
    low = nibbles(qs).reshape(-1, 32)
    return (low | (qh_bit_per_element(qh) << 4)).float()


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # 22 bytes: [0:2) d f16 | [2:6) qh u32, bit j = 5th bit of element j
    #           | [6:22) qs low 4 bits x32                   x = d * (q - 16)
    d = _f16(blocks, 0)
    return d * (_q5(blocks[:, 2:6], blocks[:, 6:]) - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # 24 bytes: [0:2) d f16 | [2:4) m f16 | [4:8) qh u32 | [8:24) qs    x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _q5(blocks[:, 4:8], blocks[:, 8:]) + m


# ---------------------------------------------------------------------------------------
# K-quants: 256-element super-blocks made of sub-blocks that carry their own scales.


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8, 1) float32.

    byte  0..3: EEaaaaaa   scale j = low 6 bits (j < 4)
    byte  4..7: EEaaaaaa   min   j = low 6 bits (j < 4)
    byte 8..11: mmmmssss   scale j+4 = s | (top 2 bits of byte j) << 4
                           min   j+4 = m | (top 2 bits of byte j+4) << 4
    """
    sc_lo, mn_lo, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 2) & 0x30)), dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 144 bytes: [0:2) d f16 | [2:4) dmin f16 | [4:16) scales/mins 6-bit x8
    #            | [16:144) qs 4-bit x256
    # 8 sub-blocks of 32; qs chunk c (32 bytes) holds sub-block 2c (low nibbles) and
    # 2c+1 (high nibbles).                       x = (d * sc) * q - (dmin * mn)
    d, dmin = _f16(blocks, 0).unsqueeze(-1), _f16(blocks, 2).unsqueeze(-1)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    q = nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return ((d * sc) * q - dmin * mn).reshape(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 176 bytes: [0:2) d | [2:4) dmin | [4:16) scales/mins | [16:48) qh x32 | [48:176) qs
    # Low nibbles as in Q4_K; the fifth bit of element i of sub-block j is bit j of qh[i].
    d, dmin = _f16(blocks, 0).unsqueeze(-1), _f16(blocks, 2).unsqueeze(-1)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    low = nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = bits(blocks[:, 16:48], 8)  # (n, 8, 32)
    q = (low | (high << 4)).float()
    return ((d * sc) * q - dmin * mn).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 210 bytes: [0:128) ql low 4 bits | [128:192) qh high 2 bits | [192:208) scales int8 x16
    #            | [208:210) d f16
    # Two halves of 128 elements; half h uses ql[64h : 64h+64] and qh[32h : 32h+32]:
    #   element 32k + i (k = 0..3, i < 32) of the half:
    #     low  = nibble k // 2 of ql[32 * (k % 2) + i]
    #     high = bits 2k..2k+1 of qh[i]
    # 16 sub-blocks of 16 share one int8 scale.          x = (d * scale) * (q - 32)
    d = _f16(blocks, 208).unsqueeze(-1)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().unsqueeze(-1)
    low = nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = bits(blocks[:, 128:192].reshape(-1, 2, 32), 8, width=2).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(-1, 16, 16)
    return ((d * scales) * q).reshape(-1, QK_K)


_DECODERS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}



def reference_decoder(qtype: gguf.GGMLQuantizationType) -> Callable[[torch.Tensor], torch.Tensor]:
    """A decoder of `qtype`'s (n, type_size) blocks into (n, block_size) float32 through
    `gguf.quants.dequantize`, the spec's own numpy code (bit-exact by definition)."""

    def decode(blocks: torch.Tensor) -> torch.Tensor:
        values = gguf.quants.dequantize(blocks.cpu().numpy(), qtype)  # (n, block_size) f32
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(blocks.device)

    return decode


_DECODERS.update((qtype, reference_decoder(qtype)) for qtype in REFERENCE_DECODED_TYPES)

# Plain float types: how their bytes are read. BF16 arrives from GGUFReader as raw uint8
# bytes, (rows, 2 * cols), not as a float array; F32/F16 arrive as float32/float16 arrays.
_FLOAT_VIEWS: dict[gguf.GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}


def owned_bytes(raw: np.ndarray) -> torch.Tensor:
    """One tensor's bytes copied out of the memmap, as a flat uint8 torch tensor.

    The copy is per tensor (never the whole file) and makes the result independent of the
    read-only mapping, which torch.from_numpy would otherwise warn about and alias.
    """
    arr = np.array(raw, order="C", copy=True)
    if arr.dtype.byteorder == ">":  # big-endian GGUF: GGUFReader marks float arrays so
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return torch.from_numpy(arr.reshape(-1).view(np.uint8))


DECODE_SLICE_BLOCKS = 1 << 16
"""Quant blocks decoded at once (2M weights of a 32-weight type: ~8 MB of float32)."""


def dequantize_tensor(
    raw: np.ndarray,
    qtype: gguf.GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode one GGUF tensor into a dense `shape` tensor of `dtype`.

    raw:    `GGUFReader.tensors[i].data`: uint8 (rows, bytes_per_row) for quantized types and
            BF16, float32 / float16 arrays for F32 / F16.
    shape:  logical row-major torch shape (GGUF `ne` reversed), e.g. (out_features, in_features).
    device: where to decode (the compressed bytes are moved there first); default CPU.
    Decoding is done in float32 and cast to `dtype` at the end.
    """
    qtype = gguf.GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_GGUF_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
        raise ValueError(
            f"GGUF tensor type {qtype.name} is not supported; supported types: {supported}. "
            "Re-quantize the model to one of these (e.g. with llama.cpp's llama-quantize)."
        )
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(shape, dtype=np.int64))
    if num_elements % block_size != 0 or raw.nbytes != num_elements // block_size * type_size:
        raise ValueError(
            f"GGUF {qtype.name} data of {raw.nbytes} bytes does not hold a tensor of shape "
            f"{tuple(shape)} ({block_size} elements per {type_size}-byte block)"
        )
    data = owned_bytes(raw).to(device)

    if qtype in _FLOAT_VIEWS:
        return data.view(_FLOAT_VIEWS[qtype]).float().reshape(shape).to(dtype)
    # (num_blocks, block_size), decoded a slice of blocks at a time into the output, so that a
    # large tensor (an embedding table) has no whole-size float temporaries
    blocks = data.view(-1, type_size)
    values = torch.empty(blocks.shape[0], block_size, dtype=dtype, device=blocks.device)
    for start in range(0, blocks.shape[0], DECODE_SLICE_BLOCKS):
        stop = start + DECODE_SLICE_BLOCKS
        values[start:stop] = _DECODERS[qtype](blocks[start:stop])
    return values.reshape(shape)

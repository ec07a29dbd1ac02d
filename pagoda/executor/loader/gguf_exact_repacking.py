"""GGUF types without a kernel format of their own whose every value another format holds
exactly: their blocks are re-encoded as that format's codes and scales (integer ops over all
blocks of a slice at once, never through float), so the packed weight dequantizes bit for bit
to what `gguf.quants.dequantize` gives and every kernel path (float32, 8-bit activations,
AMX, bf16, the whole-stack step, the MoE layer) runs it as that format.

    Q3_K   w = d * (sc - 32) * v, v in -4..3, sc 6-bit per 16   -> Q6_K (v + 32, sc - 32)
    IQ3_S  w = d * (1 + 2 s) * (+-g), g in 1..15 from its grid,  -> Q6_K (32 +- g, 1 + 2 s)
           s 4-bit per 32
    TQ2_0  w = d * (q - 1), q 2-bit                              -> Q6_K (q + 31, 1)
    IQ4_NL w = d * k[q], k its 16 int8 levels                    -> Q8_0 (k[q], d)
    MXFP4  w = 2^(e - 128) * k[q], k in -12..12                  -> Q8_0 (k[q] 2^s, 2^(e-128-s))
           where every scale of the tensor is a float16 power of two once s (0..3) is taken out

Each product is exact in float32 either way (at most 11 + 8 + 7 significant bits), so the
order of the multiplications does not matter. Q6_K holds these 2-3.5-bit types at 6.56 bits
a weight and Q8_0 the 4.25-4.5-bit ones at 8.5 (the kernels have no 2-4-bit lookup format);
the types left out (Q2_K's per-16 mins, IQ4_XS's 6-bit scales on 8-bit levels, the 1- and
2-bit grids) fit no format exactly and are requantized to Q8_0 (gguf_packing.py).

Decoders take blocks (rows * blocks_per_row, type_size) uint8 of `rows` whole rows and return
(codes (rows, K), fields) as gguf_packing's decoders do for the target format: Q6_K codes
uint8 0..63 with {"scales": float16 d (rows, K / 256), "sub_scales": int8 (rows, K / 16)};
Q8_0 codes int8 with {"scales": float16 d (rows, K / 32)}.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagoda.executor.loader.gguf_dequant import bits, nibbles

Q = gguf.GGMLQuantizationType

EXACT_REPACKING = {Q.Q3_K: Q.Q6_K, Q.IQ3_S: Q.Q6_K, Q.TQ2_0: Q.Q6_K, Q.IQ4_NL: Q.Q8_0,
                   Q.MXFP4: Q.Q8_0}
"""GGUF type -> the packed type that holds its values exactly (MXFP4: where mxfp4_fits)"""

MXFP4_SHIFT = 3
"""MXFP4 scales above float16's largest power of two (2^15) move up to 3 bits into the codes:
12 * 2^3 = 96 <= 127."""


def _f16(blocks: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).view(rows, -1)


def _q3_k(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, dict]:
    # 110 bytes: [0:32) hmask | [32:96) qs 2-bit | [96:108) 16 6-bit scales | [108:110) d
    # element 128 h + 32 j + l (l < 32): bits 2j of qs[32 h + l], bit 4h + j of hmask[l];
    # v = low - 4 where that hmask bit is clear
    low = bits(blocks[:, 32:96].reshape(-1, 2, 32), 8, width=2).reshape(-1, 256)
    high = bits(blocks[:, :32], 8).reshape(-1, 256)
    codes = low + 28 + 4 * high  # v + 32
    # scale i < 16: bits 0-3 nibble i of bytes 0-7 (low nibbles first), bits 4-5 the 2-bit
    # field i // 4 of byte 8 + i % 4
    scales = blocks[:, 96:108]
    low_bits = nibbles(scales[:, :8]).reshape(-1, 16)
    high_bits = bits(scales[:, 8:12], 8, width=2).reshape(-1, 16)
    sub_scales = ((low_bits | (high_bits << 4)).to(torch.int16) - 32).to(torch.int8)
    return codes.view(rows, -1), {"scales": _f16(blocks, 108, rows),
                                  "sub_scales": sub_scales.view(rows, -1)}


def _iq3_s_grid() -> torch.Tensor:
    """IQ3_S's 512 grid points of 4 magnitudes each, as gguf.quants decodes them."""
    gguf.quants.IQ3_S.init_grid()
    return torch.from_numpy(np.asarray(gguf.quants.IQ3_S.grid).reshape(512, 4)).to(torch.uint8)


def _iq3_s(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, dict]:
    # 110 bytes: [0:2) d | [2:66) qs | [66:74) qh | [74:106) signs | [106:110) 4-bit scales
    # grid point p < 64 (elements 4p .. 4p+3): index qs[p] | bit p % 8 of qh[p // 8] << 8;
    # element i's sign: bit i % 8 of signs[i // 8]; sub-block b < 8 (32 elements): its
    # scale nibble b % 2 (low first) of byte b // 2
    high = bits(blocks[:, 66:74], 8).transpose(-1, -2).reshape(-1, 64).to(torch.int64)
    index = blocks[:, 2:66].to(torch.int64) | (high << 8)
    magnitudes = _iq3_s_grid()[index].reshape(-1, 256)
    negative = bits(blocks[:, 74:106], 8).transpose(-1, -2).reshape(-1, 256)
    codes = torch.where(negative.bool(), 32 - magnitudes, 32 + magnitudes)
    scales = nibbles(blocks[:, 106:110]).transpose(-1, -2).reshape(-1, 8)
    sub_scales = (1 + 2 * scales).repeat_interleave(2, dim=-1).view(torch.int8)
    return codes.view(rows, -1), {"scales": _f16(blocks, 0, rows),
                                  "sub_scales": sub_scales.view(rows, -1)}


def _tq2_0(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, dict]:
    # 66 bytes: [0:64) qs 2-bit | [64:66) d; element 128 h + 32 j + l: bits 2j of qs[32h + l]
    codes = bits(blocks[:, :64].reshape(-1, 2, 32), 8, width=2).reshape(-1, 256) + 31
    sub_scales = torch.ones(blocks.shape[0], 16, dtype=torch.int8)
    return codes.view(rows, -1), {"scales": _f16(blocks, 64, rows),
                                  "sub_scales": sub_scales.view(rows, -1)}


def _levels(kvalues) -> torch.Tensor:
    return torch.tensor(kvalues, dtype=torch.int8)


def _iq4_nl(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, dict]:
    # 18 bytes: [0:2) d | [2:18) qs; element i < 16: qs[i]'s low nibble, i >= 16: high
    levels = _levels(gguf.quants.IQ4_NL.kvalues)
    codes = levels[nibbles(blocks[:, 2:18]).reshape(-1, 32).to(torch.int64)]
    return codes.view(rows, -1), {"scales": _f16(blocks, 0, rows)}


def mxfp4_fits(data) -> bool:
    """Whether every scale of an MXFP4 tensor (its raw bytes, numpy or torch, any shape) is a
    float16 power of two (2^-24 .. 2^15, the subnormals included) once up to MXFP4_SHIFT bits
    go to the codes. (17-byte blocks: [0] e, the scale 2^(e - 128).)"""
    exponents = np.asarray(data).reshape(-1, 17)[:, 0].astype(np.int32) - 128
    return bool(((exponents >= -24) & (exponents <= 15 + MXFP4_SHIFT)).all())


def _mxfp4(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, dict]:
    # 17 bytes: [0] e, the scale 2^(e - 128) (llama.cpp's e8m0 "half") | [1:17) qs as IQ4_NL's
    exponents = blocks[:, 0].to(torch.int32) - 128
    shift = (exponents - 15).clamp(0, MXFP4_SHIFT)  # (mxfp4_fits: the rest fits float16)
    levels = _levels(gguf.quants.MXFP4.kvalues)
    codes = levels[nibbles(blocks[:, 1:17]).reshape(-1, 32).to(torch.int64)]
    codes = (codes.to(torch.int32) << shift.unsqueeze(-1)).to(torch.int8)
    scales = torch.ldexp(torch.ones(()), (exponents - shift).float()).to(torch.float16)
    return codes.view(rows, -1), {"scales": scales.view(rows, -1)}


DECODERS = {Q.Q3_K: _q3_k, Q.IQ3_S: _iq3_s, Q.TQ2_0: _tq2_0, Q.IQ4_NL: _iq4_nl,
            Q.MXFP4: _mxfp4}
assert DECODERS.keys() == EXACT_REPACKING.keys()


def exact_target(ggml_type, data) -> gguf.GGMLQuantizationType | None:
    """The packed type that holds every value of this tensor (its raw bytes) exactly, or
    None where there is none."""
    if ggml_type == Q.MXFP4 and not mxfp4_fits(data):
        return None
    return EXACT_REPACKING.get(ggml_type)


def repacked_exactly(blocks: torch.Tensor, ggml_type, rows: int) -> tuple[torch.Tensor, dict]:
    """Blocks of an EXACT_REPACKING type -> its target format's (codes, fields)."""
    return DECODERS[ggml_type](blocks, rows)

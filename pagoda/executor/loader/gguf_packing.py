"""A GGUF tensor's blocks straight into a PackedWeight (pagoda/executor/kernels/
packed_weight.py), never through float: integer ops over all blocks of a slice of rows at
once (no float temporaries, no Python loop over blocks). The byte maps of the types are
gguf_dequant.py's; the result dequantizes bit for bit to what `gguf.quants.dequantize` gives.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagoda.executor.kernels.packed_weight import PackedWeight, planes_of
from pagoda.executor.kernels.packing import TILE_N
from pagoda.executor.loader.gguf_dequant import (
    REFERENCE_DECODED_TYPES,
    bits,
    nibbles,
    qh_bit_per_element,
)
from pagoda.executor.loader.gguf_exact_repacking import exact_target, repacked_exactly

Q = gguf.GGMLQuantizationType
SUPER_K = 256
GGUF_FORMATS = {Q.Q4_0: "q4", Q.Q4_1: "q4", Q.Q8_0: "q8", Q.Q5_0: "q5", Q.Q5_1: "q5",
                Q.Q4_K: "q4k", Q.Q5_K: "q5k", Q.Q6_K: "q6k"}
"""the GGUF types pack_gguf packs as they are -> their kernel format"""
REQUANTIZED_AS = Q.Q8_0
"""What the types without a packed kernel (REFERENCE_DECODED_TYPES: Q2_K, the i-quants,
TQ1_0, ...) that no format holds exactly (gguf_exact_repacking.py repacks Q3_K, IQ3_S,
TQ2_0, IQ4_NL and MXFP4 without loss) are packed as: each slice of rows is decoded by the spec
and quantized again to Q8_0, whose 8-bit codes with a scale per 32 weights hold a 2- to 4-bit
type's values to within 0.4% of each block's largest (far inside the source type's own
error), at 8.5 bits a weight instead of the file's 2-4.5."""
PACK_SLICE_WEIGHTS = 1 << 20
"""Weights packed at once by pack_gguf (a slice of whole tiles of output rows)."""


# ---------------------------------------------------------------------------------------
# GGUF blocks -> codes and scales. Each decoder takes blocks (rows * blocks_per_row,
# type_size) uint8 of `rows` whole rows and returns integer codes q (rows, K) (uint8; Q8_0
# int8) and the format's per-output fields, each (rows, count) (byte maps: gguf_dequant.py).


def _f16(blocks: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).view(rows, -1)


def _legacy_codes(blocks: torch.Tensor, qh: int | None, qs: int, rows: int) -> torch.Tensor:
    """Q4_0/Q4_1/Q5_0/Q5_1 codes: element i < 16 in qs[i]'s low nibble, i >= 16 in qs[i-16]'s
    high one; Q5: bit 4 is bit i of the little-endian uint32 at `qh`."""
    q = nibbles(blocks[:, qs:qs + 16]).reshape(-1, 32)
    if qh is not None:
        q = q | (qh_bit_per_element(blocks[:, qh:qh + 4]) << 4)
    return q.view(rows, -1)


def _implicit_min(d: torch.Tensor, zero: int) -> torch.Tensor:
    """m = -zero * d (Q4_0: 8, Q5_0: 16), exact in float16 (a power of two) unless it
    overflows."""
    m = d * -zero
    if torch.isinf(m).any() and not torch.isinf(d).any():
        raise ValueError(f"a scale of this tensor times {zero} overflows float16; it cannot be "
                         "packed exactly")
    return m


def _k_scales_mins(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 6-bit scales and mins, each (rows, K / 32) uint8."""
    sc_lo, mn_lo, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat((sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 2) & 0x30)), dim=-1)
    return sc.reshape(rows, -1), mn.reshape(rows, -1)


def _decode_legacy(blocks: torch.Tensor, ggml_type, rows: int) -> tuple[torch.Tensor, dict]:
    d = _f16(blocks, 0, rows)
    if ggml_type == Q.Q8_0:
        return blocks[:, 2:34].contiguous().view(torch.int8).view(rows, -1), {"scales": d}
    if ggml_type == Q.Q4_0:
        return _legacy_codes(blocks, None, 2, rows), {"scales": d, "mins": _implicit_min(d, 8)}
    if ggml_type == Q.Q5_0:
        return _legacy_codes(blocks, 2, 6, rows), {"scales": d, "mins": _implicit_min(d, 16)}
    m = _f16(blocks, 2, rows)
    if ggml_type == Q.Q4_1:
        return _legacy_codes(blocks, None, 4, rows), {"scales": d, "mins": m}
    return _legacy_codes(blocks, 4, 8, rows), {"scales": d, "mins": m}  # Q5_1


def _decode_kquant(blocks: torch.Tensor, ggml_type, rows: int) -> tuple[torch.Tensor, dict]:
    if ggml_type == Q.Q6_K:
        low = nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
        high = bits(blocks[:, 128:192].reshape(-1, 2, 32), 8, width=2).reshape(-1, 8, 32)
        sub_scales = blocks[:, 192:208].contiguous().view(torch.int8)
        return (low | (high << 4)).view(rows, -1), {
            "scales": _f16(blocks, 208, rows), "sub_scales": sub_scales.reshape(rows, -1)}
    fields = {"scales": _f16(blocks, 0, rows), "mins": _f16(blocks, 2, rows)}
    fields["sub_scales"], fields["sub_mins"] = _k_scales_mins(blocks[:, 4:16], rows)
    qs = 16 if ggml_type == Q.Q4_K else 48
    q = nibbles(blocks[:, qs:qs + 128].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    if ggml_type == Q.Q5_K:
        q = q | (bits(blocks[:, 16:48], 8) << 4)  # sub-block j's bit 4: bit j of qh[i]
    return q.view(rows, -1), fields


def gguf_type_packable(ggml_type, shape) -> bool:
    """Whether pack_gguf takes a tensor of this GGUF type and (out_features, in_features)
    shape."""
    try:
        ggml_type = Q(ggml_type)
    except ValueError:
        return False
    if ggml_type in REFERENCE_DECODED_TYPES:
        ggml_type = REQUANTIZED_AS  # (every source block size is a multiple of Q8_0's)
    if ggml_type not in GGUF_FORMATS or len(shape) != 2:
        return False
    block_size = gguf.GGML_QUANT_SIZES[ggml_type][0]
    return shape[0] % TILE_N == 0 and shape[1] % block_size == 0 and shape[1] > 0


def requantized(part: np.ndarray, ggml_type) -> np.ndarray:
    """(rows, row_bytes) blocks of a REFERENCE_DECODED_TYPES type -> the same rows as
    REQUANTIZED_AS blocks (rows, row_bytes'), through float32 values (rows, K) by the spec."""
    values = gguf.quants.dequantize(part, ggml_type)
    return gguf.quants.quantize(values.astype(np.float32, copy=False), REQUANTIZED_AS)


def pack_gguf(data, ggml_type, shape: tuple[int, int]) -> PackedWeight:
    """One GGUF tensor's raw bytes (numpy or torch uint8, (N, row_bytes) or flat) of type
    `ggml_type` and torch shape (N, K) -> PackedWeight, a slice of rows at a time (a
    REFERENCE_DECODED_TYPES type: repacked exactly, or requantized to REQUANTIZED_AS)."""
    source_type = Q(ggml_type)
    exact = exact_target(source_type, data)  # (None: the type packs as itself, or lossily)
    ggml_type = exact or (REQUANTIZED_AS if source_type in REFERENCE_DECODED_TYPES
                          else source_type)
    if ggml_type not in GGUF_FORMATS:
        raise ValueError(f"GGUF type {ggml_type.name} has no packed kernel format; packable: "
                         f"{', '.join(t.name for t in GGUF_FORMATS)}")
    if len(shape) != 2:
        raise ValueError(f"a packed weight is 2-D, got shape {tuple(shape)}")
    n, k = shape
    block_size, source_type_size = gguf.GGML_QUANT_SIZES[source_type]
    if not gguf_type_packable(ggml_type, shape):
        raise ValueError(f"GGUF {ggml_type.name} tensor of shape {tuple(shape)} cannot be "
                         f"packed: out_features must be a multiple of {TILE_N} and in_features "
                         f"of {block_size}")
    row_bytes = k // block_size * source_type_size
    nbytes = data.nbytes if isinstance(data, np.ndarray) else data.numel() * data.element_size()
    if nbytes != n * row_bytes or data.dtype not in (np.uint8, torch.uint8):
        raise ValueError(f"GGUF {source_type.name} data of {nbytes} bytes ({data.dtype}) is not "
                         f"the uint8 bytes of a tensor of shape {tuple(shape)}")
    data = data.reshape(n, row_bytes)
    format = GGUF_FORMATS[ggml_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]  # of the blocks decoded below
    decode = _decode_kquant if block_size == SUPER_K else _decode_legacy
    slice_rows = max(TILE_N, PACK_SLICE_WEIGHTS // k // TILE_N * TILE_N)
    planes: dict[str, torch.Tensor] = {}
    for start in range(0, n, slice_rows):
        part = data[start:start + slice_rows]
        rows = part.shape[0]
        if source_type != ggml_type and not exact:
            part = torch.from_numpy(requantized(np.asarray(part), source_type))
        elif isinstance(part, np.ndarray):  # a copy: the GGUF memmap is read-only
            part = torch.from_numpy(np.array(part, dtype=np.uint8, copy=True))
        if exact:  # the source's blocks re-encoded as ggml_type's codes and scales
            q, fields = repacked_exactly(part.contiguous().view(-1, source_type_size),
                                         source_type, rows)
        else:
            q, fields = decode(part.contiguous().view(-1, type_size), ggml_type, rows)
        for name, plane in planes_of(format, q, fields).items():
            if name not in planes:  # the whole weight's planes, filled a slice at a time
                planes[name] = plane.new_empty(n // TILE_N, *plane.shape[1:])
            planes[name][start // TILE_N:(start + rows) // TILE_N] = plane
    return PackedWeight(format, n, k, planes)

"""Quantized weights kept packed for the float32 kernels: every common GGUF type (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and Pagoda's own group quantization (packing.py).

A `PackedWeight` holds one (out_features, in_features) weight as the planes of one kernel
format (csrc/kernels.h maps them, each tile-major: [tile of 16 outputs][...]):
    "q4"  codes, scales, mins                        Q4_1; Q4_0 (m = -8 d); packing "q4"
    "q8"  codes, scales                              Q8_0; packing "q8"
    "q5"  codes, high, scales, mins                  Q5_1; Q5_0 (m = -16 d)
    "q4k" codes, scales, mins, sub_scales, sub_mins  Q4_K
    "q5k" codes, high, scales, mins, sub_scales, sub_mins   Q5_K
    "q6k" codes, high, scales, sub_scales            Q6_K
Dequantized, each weight is bit for bit what `gguf.quants.dequantize` gives; the matmul
multiplies by those weights (or an equal factored sum), so it differs from
x @ dequantize(W)^T by float32 rounding only. The packed form takes 1.0 - 1.11 times the
GGUF bytes (Q4_0 1.11: its implicit m is stored; Q5_0 1.09; K-quants 1.00 - 1.03).

pagoda/executor/loader/gguf_packing.py turns a GGUF tensor's blocks into these planes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.executor.kernels import ops
from pagoda.executor.kernels.abi import weight_format
from pagoda.executor.kernels.packing import (
    GROUP_K,
    TILE_N,
    GroupQuantized,
    by_tile,
    byte_plane,
    nibble_plane,
    pack,
)

PLANE_NAMES = ("codes", "high", "scales", "mins", "sub_scales", "sub_mins")
"""in the order the kernels take them"""
FORMAT_PLANES = {
    "q4": ("codes", "scales", "mins"),
    "q8": ("codes", "scales"),
    "q5": ("codes", "high", "scales", "mins"),
    "q4k": ("codes", "scales", "mins", "sub_scales", "sub_mins"),
    "q5k": PLANE_NAMES,
    "q6k": ("codes", "high", "scales", "sub_scales"),
}

@dataclass
class PackedWeight:
    """One (out_features, in_features) weight in kernel format `format`: `planes` holds
    those of PLANE_NAMES the format has (FORMAT_PLANES), contiguous, tile-major (dim 0 is
    the tile of 16 outputs)."""

    format: str
    out_features: int
    in_features: int
    planes: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.format not in FORMAT_PLANES:
            raise ValueError(f"unknown packed format {self.format!r}")
        if set(self.planes) != set(FORMAT_PLANES[self.format]):
            raise ValueError(f"format {self.format} has planes {FORMAT_PLANES[self.format]}, "
                             f"got {tuple(self.planes)}")
        tiles = self.out_features // TILE_N
        for name, plane in self.planes.items():
            if not plane.is_contiguous() or plane.shape[0] != tiles:
                raise ValueError(f"plane {name} must be contiguous with {tiles} tiles first, "
                                 f"got {tuple(plane.shape)}")

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Outputs start .. stop - 1 (multiples of 16), as views of this weight's planes."""
        if start % TILE_N or stop % TILE_N or not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows({start}, {stop}) of {self.out_features} outputs: bounds "
                             f"must be multiples of {TILE_N} within them")
        first, last = start // TILE_N, stop // TILE_N
        return PackedWeight(self.format, stop - start, self.in_features,
                            {name: p[first:last] for name, p in self.planes.items()})

    def input_block(self) -> int:
        """Inputs per step of the planes' second dimension (every plane is [tile][block of
        inputs]...): 32 for the 32-input formats, 256 for a K-quant's super-block scales."""
        return max(self.in_features // p.shape[1] for p in self.planes.values())

    def columns(self, start: int, stop: int) -> PackedWeight:
        """Inputs start .. stop - 1 (multiples of input_block()), copied out of the planes."""
        block = self.input_block()
        if start % block or stop % block or not 0 <= start < stop <= self.in_features:
            raise ValueError(f"columns({start}, {stop}) of {self.in_features} inputs: bounds "
                             f"must be multiples of this {self.format} weight's {block}-input "
                             f"blocks within them")
        planes = {}
        for name, p in self.planes.items():
            per_index = self.in_features // p.shape[1]
            planes[name] = p[:, start // per_index: stop // per_index].contiguous()
        return PackedWeight(self.format, self.out_features, stop - start, planes)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """The outputs of `parts` (one format and in_features) one after another."""
        first = parts[0]
        if any(p.format != first.format or p.in_features != first.in_features for p in parts):
            raise ValueError("PackedWeight.cat needs one format and in_features, got "
                             f"{[(p.format, p.in_features) for p in parts]}")
        return PackedWeight(first.format, sum(p.out_features for p in parts), first.in_features,
                            {name: torch.cat([p.planes[name] for p in parts])
                             for name in first.planes})

    def dequantize(self) -> torch.Tensor:
        """(out_features, in_features) float32."""
        return dequantize_rows(self, torch.arange(self.out_features))

    def pointers(self) -> list[int | None]:
        """The planes' addresses in the kernels' order (None where the format has none)."""
        return [self.planes[name].data_ptr() if name in self.planes else None
                for name in PLANE_NAMES]


def _kernels():
    lib = ops.load_cpu_kernels()
    if lib is None:
        raise RuntimeError("packed weights need Pagoda's CPU kernels, unavailable here")
    return lib


def gemm_packed(x: torch.Tensor, w: PackedWeight, rowwise: bool = False,
                large_batch_dtype: torch.dtype = torch.float32,
                activation_parts: int = 0) -> torch.Tensor:
    """x (M, K) float32 contiguous @ W^T -> (M, N) float32. From ops.DEQUANTIZE_FROM_ROWS
    rows on, W is dequantized a slice at a time for torch's matmul (prefills), in
    `large_batch_dtype`: float32, or bfloat16 (x and the weights rounded to bf16, products
    summed in float32 by oneDNN, the result rounded to bf16: AMX's rate where the CPU has it;
    arithmetic.py chooses). Fewer rows take the packed kernel: float32 products, or with
    `activation_parts` 1 (2) x quantized per 32 inputs to 8 (16) bits and integer dot
    products (gemm_int8.c; Q8 weights stay float32). `rowwise`: batch-invariant, row m of
    the result bit for bit what x[m:m+1] alone gives, whatever M (the kernel's one-row tiles
    at every M; --deterministic)."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous() \
            or x.shape[1] != w.in_features:
        raise ValueError(f"gemm_packed takes a contiguous float32 (M, {w.in_features}) input, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if x.shape[0] == 0:
        return x.new_empty(0, w.out_features)
    if x.shape[0] >= ops.DEQUANTIZE_FROM_ROWS and not rowwise:
        return ops.dequantized_matmul(
            x, w.out_features,
            lambda start, stop: dequantize_transposed(w.rows(start, stop), dtype=large_batch_dtype),
            large_batch_dtype)
    y = x.new_empty(x.shape[0], w.out_features)
    lib, format = _kernels(), weight_format(w.format)
    operands = (x.data_ptr(), x.shape[0], w.in_features, w.out_features, *w.pointers(),
                y.data_ptr())
    if rowwise:
        lib.pagoda_gemm_packed_rowwise_f32(format, *operands)
    elif activation_parts:
        lib.pagoda_gemm_packed_int8_f32(format, activation_parts, *operands)
    else:
        lib.pagoda_gemm_packed_f32(format, *operands)
    return y


def dequantize_transposed(w: PackedWeight, out: torch.Tensor | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W^T (in_features, out_features) in float32, or bfloat16 (the float32 weights rounded
    to nearest even), for x @ W^T by a BLAS matmul; written into `out` when given."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed weights dequantize to float32 or bfloat16, not {dtype}")
    if out is None:
        out = torch.empty(w.in_features, w.out_features, dtype=dtype)
    lib = _kernels()
    dequantize = (lib.pagoda_dequantize_packed_bf16 if dtype == torch.bfloat16
                  else lib.pagoda_dequantize_packed_f32)
    dequantize(weight_format(w.format), w.in_features, w.out_features, *w.pointers(),
               out.data_ptr())
    return out


def dequantize_rows(w: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """rows (T,) integer indices of outputs -> (T, in_features) float32: W[rows] (an
    embedding lookup)."""
    rows = rows.to(torch.int64).contiguous().view(-1)
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < w.out_features):
        raise IndexError(f"row indices must lie in [0, {w.out_features})")
    out = torch.empty(rows.numel(), w.in_features)
    _kernels().pagoda_dequantize_rows_packed_f32(
        weight_format(w.format), w.in_features, w.out_features, *w.pointers(), rows.data_ptr(),
        rows.numel(), out.data_ptr())
    return out


def plane_list(w: PackedWeight) -> list[torch.Tensor | None]:
    """The planes in PLANE_NAMES order, None where the format has none (the ops' arguments)."""
    return [w.planes.get(name) for name in PLANE_NAMES]


def _from_plane_list(format: str, out_features: int, in_features: int, planes) -> PackedWeight:
    return PackedWeight(format, out_features, in_features,
                        {name: p for name, p in zip(PLANE_NAMES, planes) if p is not None})


# Graph-facing ops for torch.compile, which treats them as opaque (as ops.py's gemm_q):
# gemm_packed_op(x, format, out_features, large_batch_bf16, activation_parts, *plane_list(w))
# and
# dequantize_rows_op(rows, format, out_features, in_features, *plane_list(w)).
_library = torch.library.Library("pagoda", "FRAGMENT")
_PLANE_ARGS = ", ".join(f"Tensor? {name}" for name in PLANE_NAMES)
_library.define(f"gemm_packed(Tensor x, str format, int out_features, bool large_batch_bf16, "
                f"int activation_parts, {_PLANE_ARGS}) -> Tensor")
_library.define(f"dequantize_rows_packed(Tensor rows, str format, int out_features, "
                f"int in_features, {_PLANE_ARGS}) -> Tensor")
_library.impl("gemm_packed", lambda x, format, out_features, large_batch_bf16, activation_parts,
              *planes: gemm_packed(
                  x, _from_plane_list(format, out_features, x.shape[1], planes),
                  large_batch_dtype=torch.bfloat16 if large_batch_bf16 else torch.float32,
                  activation_parts=activation_parts), "CPU")
_library.impl("dequantize_rows_packed", lambda rows, format, out_features, in_features, *planes:
              dequantize_rows(_from_plane_list(format, out_features, in_features, planes), rows),
              "CPU")
gemm_packed_op = torch.ops.pagoda.gemm_packed
dequantize_rows_op = torch.ops.pagoda.dequantize_rows_packed


@torch.library.register_fake("pagoda::gemm_packed")
def _(x, format, out_features, large_batch_bf16, activation_parts, *planes):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pagoda::dequantize_rows_packed")
def _(rows, format, out_features, in_features, *planes):
    return rows.new_empty(rows.numel(), in_features, dtype=torch.float32)


def from_group_quantized(quantized: GroupQuantized) -> PackedWeight:
    """packing.py's group quantization ("q4" / "q8") as a PackedWeight."""
    codes, scales, mins = pack(quantized)
    planes = {"codes": codes, "scales": scales}
    if mins is not None:
        planes["mins"] = mins
    n, k = quantized.codes.shape
    return PackedWeight(quantized.format, n, k, planes)


def _high_slot(k: int, bits: int) -> tuple[int, int]:
    """(word, bit) where the high plane keeps input k's bits 4 .. 3 + bits (kernels.h): the
    pairs 4c, 4c + 1 and 4c + 2, 4c + 3 of chunk c take slot u = 2c, 2c + 1, their second
    input 8 bits above the first."""
    c, i = divmod(k, 4)
    u, second = 2 * c + i // 2, i % 2
    if bits == 1:
        return 0, u % 8 + 16 * (u // 8) + 8 * second
    return u // 8, 2 * (u % 4) + 16 * (u % 8 // 4) + 8 * second


def _high_plane(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (N, K) uint8 -> their bits 4 .. 3 + bits as kernels.h's high plane, uint8
    (tiles, groups, words, TILE_N, 4): each (group, word, lane) a little-endian uint32."""
    n, k = q.shape
    high = (q >> 4).view(n // TILE_N, TILE_N, k // GROUP_K, GROUP_K)
    packed = torch.zeros(n // TILE_N, TILE_N, k // GROUP_K, bits, 4, dtype=torch.uint8)
    for k_in_group in range(GROUP_K):  # 32 vectorized steps, one per input of a group
        word, bit = _high_slot(k_in_group, bits)
        packed[:, :, :, word, bit // 8] |= high[..., k_in_group] << (bit % 8)
    return packed.permute(0, 2, 3, 1, 4).contiguous()


def planes_of(format: str, q: torch.Tensor, fields: dict) -> dict[str, torch.Tensor]:
    """Integer codes q (N, K) and per-output fields ("scales", "mins", "sub_scales",
    "sub_mins": each (N, count)) -> the format's tile-layout planes."""
    if format == "q8":
        planes = {"codes": byte_plane(q)}
    else:
        planes = {"codes": nibble_plane(q & 15)}
    if format in ("q5", "q5k", "q6k"):
        planes["high"] = _high_plane(q, 2 if format == "q6k" else 1)
    for name, values in fields.items():
        if name == "sub_scales" and format == "q6k":  # (N, groups * 2) -> [tile][group][j][lane]
            n = values.shape[0]
            values = values.view(n // TILE_N, TILE_N, -1, 2).permute(0, 2, 3, 1).contiguous()
            planes[name] = values
        else:
            planes[name] = by_tile(values)
    return planes

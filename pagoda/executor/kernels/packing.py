"""Group-quantize a weight and pack it in the tile layout of the kernels' gemm_q (csrc/kernels.h).

Formats (w: one weight, groups of GROUP_K consecutive inputs of one output row, float16
scales, as GGUF stores them):
    "q4": w = d * q + m, q in [0, 15], d = (max - min) / 15, m = min      (GGUF Q4_1)
    "q8": w = d * q,     q in [-127, 127], d = max |w| / 127              (GGUF Q8_0)
A GGUF Q4_1 / Q8_0 tensor, dequantized, comes back to its own codes and scales: its group
minimum sits at q = 0 (Q8_0: its largest magnitude at +-127) by the way GGUF quantizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_K = 32
TILE_N = 16
FORMATS = ("q4", "q8")
"""The formats pack() writes (their codes: abi.WeightFormat)."""


@dataclass
class GroupQuantized:
    """codes (N, K) int16 (q4: 0..15, q8: -127..127); scales, mins (N, K / GROUP_K) float16
    (mins None for q8)."""

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: the weights the codes stand for."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // GROUP_K, GROUP_K) * self.scales.float()[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        return w.view(n, k)


def check_packable(out_features: int, in_features: int) -> None:
    if out_features % TILE_N or in_features % GROUP_K:
        raise ValueError(
            f"group quantization needs output sizes divisible by {TILE_N} and input sizes by "
            f"{GROUP_K}; this layer is {in_features} -> {out_features}"
        )


def quantize_groups(weight: torch.Tensor, format: str) -> GroupQuantized:
    """weight (N, K) float -> GroupQuantized, round to nearest."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    n, k = weight.shape
    check_packable(n, k)
    groups = weight.detach().float().view(n, k // GROUP_K, GROUP_K)
    tiny = torch.finfo(torch.float16).tiny
    if format == "q4":
        mins = groups.amin(dim=-1).half()
        scales = ((groups.amax(dim=-1) - mins.float()) / 15).clamp(min=tiny).half()
        codes = ((groups - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
    else:
        mins = None
        scales = (groups.abs().amax(dim=-1) / 127).clamp(min=tiny).half()
        codes = (groups / scales.float()[..., None]).round().clamp(-127, 127)
    return GroupQuantized(format, codes.to(torch.int16).view(n, k), scales, mins)


def nibble_plane(low: torch.Tensor) -> torch.Tensor:
    """codes (N, K) uint8 in [0, 15] -> the Q4 nibble plane (tiles, groups, 8, TILE_N, 2)
    uint8 (csrc/kernels.h): [tile][group][c][lane][half], low nibble from pair 2c, high from
    pair 2c + 1."""
    n, k = low.shape
    # (tile, lane, group, c, pair of c, half): n = tile*16 + lane, k = group*32 + 4c + 2 pair + half
    q = low.view(n // TILE_N, TILE_N, k // GROUP_K, GROUP_K // 4, 2, 2)
    q = q.permute(0, 2, 3, 4, 1, 5)  # (tile, group, c, pair of c, lane, half)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).contiguous()


def byte_plane(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) int8 -> the Q8 plane (tiles, groups, 16, 2, TILE_N) uint8:
    [tile][group][pair][half][lane]."""
    n, k = codes.shape
    # (tile, lane, group, pair, half): n = tile*16 + lane, k = group*32 + 2 pair + half
    q = codes.view(n // TILE_N, TILE_N, k // GROUP_K, GROUP_K // 2, 2)
    return q.permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8)


def by_tile(t: torch.Tensor) -> torch.Tensor:
    """(N, X) per-output values -> (tiles, X, TILE_N): [tile][x][lane]."""
    n, width = t.shape
    return t.view(n // TILE_N, TILE_N, width).transpose(1, 2).contiguous()


def pack(quantized: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (codes uint8, scales float16, mins float16 or None) in gemm_q's tile layout (see
    csrc/kernels.h): q4 codes [tile][group][c][lane][half], low nibble from pair 2c, high from
    pair 2c + 1; q8 codes [tile][group][pair][half][lane] int8; scales, mins [tile][group][lane]."""
    if quantized.format == "q4":
        codes = nibble_plane(quantized.codes.to(torch.uint8))
    else:
        codes = byte_plane(quantized.codes.to(torch.int8))
    mins = None if quantized.mins is None else by_tile(quantized.mins)
    return codes, by_tile(quantized.scales), mins


def quantize_and_pack(
    weight: torch.Tensor, format: str, rows_per_slice: int = 4096
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """pack(quantize_groups(weight, format)), a slice of output rows at a time (a multiple
    of TILE_N: the packed layout is tile-major, so slices concatenate), so that a large
    weight (a logits head) never has whole-size float temporaries."""
    parts = [pack(quantize_groups(weight[start:start + rows_per_slice], format))
             for start in range(0, weight.shape[0], rows_per_slice)]
    codes, scales, mins = zip(*parts)
    return (torch.cat(codes), torch.cat(scales),
            None if mins[0] is None else torch.cat(mins))

"""One adapter over one Pagoda module: the PEFT targets that module fuses, as one shrink
matrix and one expand block per target.

    qkv_proj      rows [q | k | v]     targets q_proj, k_proj, v_proj      (up to 3 parts)
    gate_up_proj  rows [gate | up]     targets gate_proj, up_proj          (up to 2 parts)
    o_proj        single               target o_proj                       (1 part)
    down_proj     single               target down_proj                    (1 part)

    FusedLoRA.a   (R, in)   every present target's A stacked (R = the sum of their ranks):
                            one product x @ a^T shrinks a row for all of them at once
    LoRAPart.b_t  (rank, out_size)  that target's B transposed (B^T, contiguous), pre-multiplied
                            by its scale; its columns land at out_offset..out_offset+out_size
                            of the module's output, its rows take rank_offset..+rank of the
                            shrunk row

So delta(x)[:, part.out_offset + o] = sum_k (x @ a^T)[:, part.rank_offset + k] * part.b_t[k, o].
A target the adapter lacks is a missing part (its rows get nothing). B^T is the layout the
whole-stack C decode step reads (whole-vector loads over outputs), so it points at these
tensors themselves: an adapter's numbers are held once.

Storage dtype (LoRAConfig.lora_dtype): a and every b_t are one of STORAGE_DTYPES (float32,
bfloat16, float16), the same for all of an adapter's tensors. The products are computed in
torch.promote_types(activations, storage): float32 activations always multiply in float32
(a bf16 / f16 adapter is widened per call, the numbers C widens as it loads them).

Tensor parallelism cuts an adapter like its base layer (parallel/sharding.py): a
column-parallel module (qkv, gate_up) keeps A whole and takes this rank's rows of each B;
a row-parallel one (o, down: RowParallelLinear.inner holds this rank's input columns) takes
those columns of A and the whole B, so the layer's all-reduce sums the partial deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.executor.layers.linear import linear_rows

MODULE_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""Pagoda's hooked modules, in a layer's order, and the PEFT targets each fuses (row order)."""


STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The numbers an adapter's fused tensors may be stored in (the C kernel's LORA_* dtypes)."""


@dataclass
class LoRAPart:
    out_offset: int
    out_size: int
    rank_offset: int
    rank: int
    b_t: torch.Tensor
    """(rank, out_size), contiguous, B^T with the scale folded in; the adapter's dtype."""


@dataclass
class FusedLoRA:
    a: torch.Tensor
    """(R, in), contiguous: the parts' A matrices stacked in part order (one of
    STORAGE_DTYPES, shared by every part's b_t)."""
    parts: list[LoRAPart]

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(part.b_t.nbytes for part in self.parts)

    def to(self, device: torch.device) -> FusedLoRA:
        """This adapter with its tensors on `device` (itself where they are there)."""
        if self.a.device == device:
            return self
        return FusedLoRA(self.a.to(device), [
            LoRAPart(p.out_offset, p.out_size, p.rank_offset, p.rank, p.b_t.to(device))
            for p in self.parts])

    def add_to(self, out: torch.Tensor, x: torch.Tensor, row_wise: bool = False) -> None:
        """out (n, out_features) += this adapter's delta for x (n, in), in place, computed in
        promote_types(x, storage) (float32 activations: float32). `row_wise`: each row's
        products computed alone (--deterministic: a row's bits then do not depend on the
        other rows, see executor/batch_invariant.py)."""
        product = linear_rows if row_wise else F.linear
        compute = torch.promote_types(x.dtype, self.a.dtype)
        shrunk = product(x.to(compute), self.a.to(compute))  # (n, R)
        for part in self.parts:
            delta = product(shrunk[:, part.rank_offset:part.rank_offset + part.rank],
                            part.b_t.to(compute).T)
            out[:, part.out_offset:part.out_offset + part.out_size] += delta.to(out.dtype)

    def delta(self, x: torch.Tensor, out_features: int, row_wise: bool = False) -> torch.Tensor:
        """The (n, out_features) delta for x (n, in), in promote_types(x, storage)."""
        out = torch.zeros(x.shape[0], out_features,
                          dtype=torch.promote_types(x.dtype, self.a.dtype), device=self.a.device)
        self.add_to(out, x, row_wise)
        return out


@dataclass(frozen=True)
class ModuleShape:
    """How one hooked module's output and input relate to its targets' whole matrices.

    `rows`: per target (MODULE_TARGETS order), the [start, stop) of that target's own output
    rows this module computes (all of them without tensor parallelism); `columns`: the
    [start, stop) of the input this module sees (a row-parallel shard's), None: all."""

    targets: tuple[str, ...]
    out_sizes: tuple[int, ...]
    """Each target's whole output size (the adapter's B rows)."""
    in_features: int
    """The whole input size (the adapter's A columns)."""
    rows: tuple[tuple[int, int], ...]
    columns: tuple[int, int] | None = None


def storage_dtype(pairs: dict) -> torch.dtype:
    """The dtype an adapter's `pairs` are fused in: theirs where all share one of
    STORAGE_DTYPES, else float32 (exactly, for float16 and bfloat16 alike)."""
    dtypes = {t.dtype for pair in pairs.values() for t in (pair.a, pair.b)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(STORAGE_DTYPES) else torch.float32


def fuse(shape: ModuleShape, pairs: dict, layer: int,
         dtype: torch.dtype = torch.float32) -> FusedLoRA | None:
    """The FusedLoRA of one adapter's `pairs` ({(layer, target): LoRAPair}, B (out, rank)
    pre-scaled) for the module `shape` describes at `layer`, its tensors in `dtype` (one of
    STORAGE_DTYPES; B transposed once, here); None where the adapter has none of its
    targets. ValueError where a pair's shapes disagree with the base's."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"LoRA adapters are stored in float32, bfloat16 or float16, not {dtype}")
    a_blocks, parts, rank_offset, out_offset = [], [], 0, 0
    for target, out_size, (start, stop) in zip(shape.targets, shape.out_sizes, shape.rows,
                                               strict=True):
        pair = pairs.get((layer, target))
        if pair is not None:
            rank = pair.a.shape[0]
            if tuple(pair.a.shape) != (rank, shape.in_features) or \
                    tuple(pair.b.shape) != (out_size, rank):
                raise ValueError(
                    f"LoRA layer {layer} {target}: A {tuple(pair.a.shape)} and B "
                    f"{tuple(pair.b.shape)} do not fit the base's ({out_size}, "
                    f"{shape.in_features}) projection")
            a = pair.a if shape.columns is None else pair.a[:, shape.columns[0]:shape.columns[1]]
            a_blocks.append(a.to(dtype))
            parts.append(LoRAPart(out_offset, stop - start, rank_offset, rank,
                                  pair.b[start:stop].to(dtype).T.contiguous()))
            rank_offset += rank
        out_offset += stop - start
    if not parts:
        return None
    return FusedLoRA(torch.cat(a_blocks).contiguous(), parts)

"""Linear layers and embeddings over weights a checkpoint already holds quantized (a GGUF
file's Q4_0 ... Q6_K tensors), run packed by Pagoda's CPU kernels: no float copy of a
weight exists at any time (pagoda/executor/kernels/packed_weight.py holds the formats).

A fused projection (qkv, gate/up) whose parts the file stores in different types (a Q4_K_M
file keeps v in Q6_K where q and k are Q4_K) is a list of segments, one matmul each, written
side by side into the output:

    outputs:  [ segment 0 (q, k: q4k) | segment 1 (v: q6k) ]

Activations: float32 through the float32 kernels (every CPU). Other dtypes (bfloat16 where
the CPU has AVX-512 BF16) take the bf16 kernels for formats they have (q4, q8) and small
batches, else are converted to float32 for the product and back: the weight stays packed.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.kernels.abi import MAX_SEGMENTS, DecoderLinear, weight_format
from pagoda.executor.kernels.ops import gemm_q, gemm_q_op, kernels_available
from pagoda.executor.kernels.packed_weight import (
    PLANE_NAMES,
    PackedWeight,
    dequantize_rows,
    dequantize_rows_op,
    gemm_packed,
    gemm_packed_op,
    plane_list,
)

BF16_KERNEL_FORMATS = ("q4", "q8")
"""Formats the bf16 kernels (csrc/avx512_bf16.c) multiply; others run in float32."""
BF16_KERNEL_BELOW_ROWS = 32
"""Below this many bf16 rows a q4 / q8 segment takes the bf16 kernel; from it on the rows are
multiplied in float32 (quantization.py's DEFAULT_DENSE_FROM_ROWS: where a bf16 matmul wins)."""


def merge_segments(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Consecutive parts of one format concatenated: as few matmuls as the formats allow."""
    segments: list[list[PackedWeight]] = []
    for part in parts:
        if segments and segments[-1][0].format == part.format:
            segments[-1].append(part)
        else:
            segments.append([part])
    return [group[0] if len(group) == 1 else PackedWeight.cat(group) for group in segments]


class PackedLinear(nn.Module):
    """y = x W^T (+ b), W the concatenation (along outputs) of packed `parts`.
    Input (..., in_features) in any float dtype; output (..., out_features) in the same."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a packed linear needs parts with one input size")
        self.segments = merge_segments(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias
        self.bf16_kernels = kernels_available(torch.bfloat16)
        """Whether the bf16 kernels run here: asked once, not per call (the question is no
        graph op: under torch.compile it would break the graph at every linear)."""

    bf16_kernel_below_rows: int | None = BF16_KERNEL_BELOW_ROWS
    """bf16 rows of a q4 / q8 segment take the bf16 kernel below this many (None: always)."""
    takes_float32 = True
    """Float32 rows run the float32 kernels on every CPU (a logits head is fed float32)."""
    batch_invariant = False
    """Set by executor/batch_invariant.py: float32 rows through the row-wise kernel."""
    large_batch_dtype: torch.dtype = torch.float32
    """What float32 batches of ops.DEQUANTIZE_FROM_ROWS rows or more are multiplied in
    (kernels/arithmetic.py chooses; set_arithmetic sets it on a model)."""
    activation_parts = 0
    """Smaller float32 batches: 0 multiply float32 activations; 1 (2) quantize them to 8
    (16) bits for integer dot products (gemm_int8.c)."""

    @property
    def formats(self) -> list[str]:
        return [segment.format for segment in self.segments]

    def nbytes(self) -> int:
        return sum(segment.nbytes() for segment in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # (M, in)
        if self.batch_invariant:
            matmul = lambda segment: gemm_packed(rows, segment, rowwise=True)
        else:
            matmul = lambda segment: self._matmul(rows, segment)
        if len(self.segments) == 1:
            y = matmul(self.segments[0])
        else:
            y = torch.cat([matmul(segment) for segment in self.segments], dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()  # then the opaque ops (packed_weight.py)
        below = self.bf16_kernel_below_rows
        if (rows.dtype == torch.bfloat16 and weight.format in BF16_KERNEL_FORMATS
                and (below is None or rows.shape[0] < below) and self.bf16_kernels):
            planes = weight.planes
            return (gemm_q_op if compiling else gemm_q)(
                rows, planes["codes"], planes["scales"], planes.get("mins"), weight.format,
                weight.out_features)
        x = rows if rows.dtype == torch.float32 else rows.float()
        bf16_large = self.large_batch_dtype == torch.bfloat16
        if compiling:
            y = gemm_packed_op(x, weight.format, weight.out_features, bf16_large,
                               self.activation_parts, *plane_list(weight))
        else:
            y = gemm_packed(x, weight, large_batch_dtype=self.large_batch_dtype,
                            activation_parts=self.activation_parts)
        return y.to(rows.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(self.formats)}")


def decoder_linear(module: nn.Module) -> DecoderLinear | None:
    """The C kernels' description of a linear layer (struct pagoda_decoder_linear: pointers
    to its packed planes and bias), for the code that runs it from C (whole_stack_decode.py,
    layers/moe_kernel.py): a PackedLinear's (a GGUF file's own types, or `--quantization
    int4/int8` of a float checkpoint and AWQ / GPTQ folders: a QuantizedLinear's one segment)
    where it runs Pagoda's float32 kernels on its packed weight alone, in at most
    MAX_SEGMENTS segments; None for any other linear. The module must outlive it."""
    if not (isinstance(module, PackedLinear) and module.segments and module.takes_float32):
        return None
    bias = module.bias
    if len(module.segments) > MAX_SEGMENTS or (bias is not None and (
            bias.dtype != torch.float32 or not bias.is_contiguous())):
        return None
    linear = DecoderLinear(num_segments=len(module.segments), in_features=module.in_features,
                           out_features=module.out_features,
                           bias=None if bias is None else bias.data_ptr(),
                           activation_parts=module.activation_parts)
    for slot, segment in zip(linear.segments, module.segments):
        slot.format, slot.out_features = weight_format(segment.format), segment.out_features
        for name in PLANE_NAMES:
            plane = segment.planes.get(name)
            setattr(slot, name, None if plane is None else plane.data_ptr())
    return linear


def _head_linears(model: nn.Module) -> list[PackedLinear]:
    head = getattr(model, "quantized_head", None)
    if not isinstance(head, nn.Module):
        return []
    return [m for m in head.modules() if isinstance(m, PackedLinear)]


def body_linears(model: nn.Module) -> list[PackedLinear]:
    """Every packed linear of `model` but its logits head's."""
    in_head = {id(m) for m in _head_linears(model)}
    return [m for m in model.modules() if isinstance(m, PackedLinear) and id(m) not in in_head]


HEAD_ACTIVATION_PARTS = (0, 0, 2)
"""The logits head's activation_parts for each of the body's: float32 unless 16-bit (whose
products are float32's to ~2e-5, KL 5e-8: the logits the sampler ranks are float32 sums of
the same precision); never bf16 or 8-bit, whose rounding makes near- and exact ties of the
top logits (the bundled model's first answer token was one)."""


def set_arithmetic(model: nn.Module, large_batch_dtype: torch.dtype,
                   activation_parts: int = 0) -> int:
    """Every packed linear of `model` but its logits head multiplies large float32 batches
    in `large_batch_dtype` (float32 or bfloat16) and small ones with float32 activations or
    `activation_parts` 8-bit parts of them (kernels/arithmetic.py); returns how many there
    are. The head keeps float32 large batches, and small ones per HEAD_ACTIVATION_PARTS."""
    linears = body_linears(model)
    for linear in linears:
        linear.large_batch_dtype = large_batch_dtype
        linear.activation_parts = activation_parts
    for head in _head_linears(model):
        head.large_batch_dtype = torch.float32
        head.activation_parts = HEAD_ACTIVATION_PARTS[activation_parts]
    return len(linears)


class PackedEmbedding(nn.Module):
    """Token embedding over a packed (vocab_size, hidden) table: a lookup dequantizes only
    the rows it reads. ids (...) int64 -> (..., hidden) in `dtype`."""

    def __init__(self, table: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat, table = ids.reshape(-1).to(torch.int64), self.table
        if torch.compiler.is_compiling():
            rows = dequantize_rows_op(flat, table.format, table.out_features, table.in_features,
                                      *plane_list(table))
        else:
            rows = dequantize_rows(table, flat)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.table.format}"

"""Weight-only quantized linear layers (`--quantization int8|int4`), CPU only.

Weights are quantized once after loading, round to nearest, in groups of 32 inputs with
float16 scales (pagoda/executor/kernels/packing.py):

    int4: w = d * q + m, q in [0, 15]        GGUF's Q4_1 form
    int8: w = d * q,     q in [-127, 127]    GGUF's Q8_0 form

A GGUF Q4_1 (Q8_0) tensor comes back to its own codes and scales, so on the bundled Q4_1
model `--quantization int4` multiplies by the weights the file holds, kept in 4 bits.
Activations stay in the run dtype. With quantization on, the logits head is int8 too: in
SmolLM2 it is the tied embedding table, which the GGUF file holds as Q8_0.

Kernels, per layer, chosen once (`QuantizedLinear.kernel`):
- "pagoda": Pagoda's own C kernels (pagoda/executor/kernels/csrc/), which decode a tile of
  weights once and reuse it for every row of the step. The weight is then a PackedWeight
  in format "q4" / "q8" (kernels/packed_weight.py) and the layer a PackedLinear of that
  one segment, run as a GGUF file's packed weights are: one quantized-linear stack.
  - bf16 activations on CPUs with AVX-512 BF16 (avx512_bf16.c). PyTorch's int4/int8
    kernels dequantize per row and are slower than a bf16 matmul from ~8 rows on; this one
    stays fast up to 16 rows. From `dense_from_rows` rows on (prefills, large batches) a
    layer takes the float weight it keeps (oneDNN's bf16 matmul wins there): memory for
    speed. Pass dense_from_rows=None for quantized weights only.
  - float32 activations on every CPU (gemm_f32.c: AVX2, AVX-512F, NEON, generic). No
    float weight is kept: from ops.DEQUANTIZE_FROM_ROWS rows on the kernel dequantizes the
    weight slice by slice for a BLAS matmul, so the model stays at its 4-bit size.
  Timings: benchmarks/bench_quantized_matmul.py (results in BENCHMARKS.md).
- "torch-int4": elsewhere (no C compiler), int4 through torch._weight_int4pack_mm_for_cpu.
- "dense": elsewhere, int8 as the dequantized weight through F.linear (the same numbers, no
  speed-up; PyTorch's int8 kernel has no per-group scales).

Accuracy on the bundled model against float32: tests/executor/test_fidelity.py (figures in
BENCHMARKS.md). With float32 activations int4 multiplies by the very weights the
float32 run uses (the file's Q4_1 codes), so only summation order differs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import QUANTIZATION_METHODS
from pagoda.executor.kernels.ops import kernels_available
from pagoda.executor.kernels.packed_weight import PackedWeight
from pagoda.executor.kernels.packing import (
    GROUP_K,
    GroupQuantized,
    check_packable,
    quantize_and_pack,
    quantize_groups,
)
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.packed_linear import BF16_KERNEL_BELOW_ROWS, PackedLinear

logger = logging.getLogger(__name__)

METHOD_FORMATS = {"int4": "q4", "int8": "q8"}
"""--quantization method -> group format of pagoda/executor/kernels/packing.py"""
HEAD_METHOD = "int8"
INT4_INNER_K_TILES = 2
"""Packing parameter of PyTorch's CPU int4 kernel (2, 4 or 8); 2 accepts any K % 32 == 0."""
DEFAULT_DENSE_FROM_ROWS = BF16_KERNEL_BELOW_ROWS
"""From this many rows a step's matmul takes the float weight (see the docstring)."""


def check_quantization_supported(method: str, device: torch.device) -> None:
    """Raise ValueError where `method` cannot run on `device`."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
        )
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {method} runs on CPU only (its kernels are CPU kernels), not on "
            f"{device}; use --device cpu or drop --quantization"
        )


def choose_kernel(method: str, dtype: torch.dtype) -> str:
    """"pagoda", "torch-int4" or "dense" (see the module docstring)."""
    if kernels_available(dtype):
        return "pagoda"
    return "torch-int4" if method == "int4" else "dense"


def torch_int4_scales_and_zeros(quantized: GroupQuantized) -> torch.Tensor:
    """(K / 32, N, 2) float32 for PyTorch's int4 kernel, which computes (q - 8) * scale + zero."""
    scales, mins = quantized.scales.float(), quantized.mins.float()  # (N, G)
    return torch.stack((scales, mins + 8 * scales), dim=-1).transpose(0, 1).contiguous()


class QuantizedLinear(PackedLinear):
    """y = x W^T (+ b) with W int8 or int4 (see the module docstring). Input (..., in) in the
    run dtype; output (..., out) in the same dtype.

    On Pagoda's kernel the weight is one PackedWeight ("q4" / "q8"), the layer's one segment:
    a PackedLinear like a GGUF file's, which is how every consumer (the whole-stack decode
    step, --deterministic, tensor-parallel slicing) reads it. The fallback kernels hold
    their own tensors (`fallback_codes`, `fallback_scales`) and no segment.

    `dense_weight`: the float weight, used from `dense_from_rows` rows on (None: never)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        method: str,
        dense_from_rows: int | None = DEFAULT_DENSE_FROM_ROWS,
    ) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"quantized weights must be on the CPU, got {weight.device}")
        if method not in METHOD_FORMATS:
            raise ValueError(f"unknown quantization method {method!r}")
        check_packable(*weight.shape)
        kernel = choose_kernel(method, weight.dtype)
        if kernel == "pagoda":
            self._init_layer(method, kernel, weight.shape, bias,
                             packed=packed_weight(METHOD_FORMATS[method], weight.shape,
                                                  quantize_and_pack(weight, METHOD_FORMATS[method])))
        else:
            self._init_layer(method, kernel, weight.shape, bias,
                             fallback=quantize_groups(weight, METHOD_FORMATS[method]),
                             dtype=weight.dtype)
        # The float32 kernel multiplies large batches by a dequantized slice instead.
        keep_dense = dense_from_rows is not None and not (
            self.kernel == "pagoda" and weight.dtype == torch.float32)
        self.dense_weight = weight if keep_dense else None
        self.dense_from_rows = dense_from_rows

    def _init_layer(
        self, method: str, kernel: str, shape: tuple[int, int], bias: torch.Tensor | None,
        packed: PackedWeight | None = None, fallback: GroupQuantized | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """The layer over `packed` (Pagoda's kernel) or, for the fallback kernels, the group
        quantized `fallback` in the `dtype` the layer runs."""
        nn.Module.__init__(self)
        self.method, self.format, self.kernel = method, METHOD_FORMATS[method], kernel
        self.out_features, self.in_features = shape
        self.segments = [] if packed is None else [packed]
        self.bf16_kernels = kernel == "pagoda" and kernels_available(torch.bfloat16)
        codes = scales = None
        if kernel == "torch-int4":
            codes = torch._convert_weight_to_int4pack_for_cpu(fallback.codes.int(),
                                                              INT4_INNER_K_TILES)
            scales = torch_int4_scales_and_zeros(fallback).to(dtype)
        elif kernel == "dense":
            codes = fallback.dequantize().to(dtype)
        self.register_buffer("fallback_codes", codes)
        self.register_buffer("fallback_scales", scales)
        self.bias = bias
        self.dense_weight, self.dense_from_rows = None, None

    bf16_kernel_below_rows = None
    """Pagoda's bf16 kernel at any row count: large batches take the float weight where the
    layer keeps one (dense_from_rows)."""

    @property
    def codes(self) -> torch.Tensor:
        """The packed codes plane (Pagoda's kernel), else the fallback kernel's codes."""
        return self.segments[0].planes["codes"] if self.segments else self.fallback_codes

    @property
    def scales(self) -> torch.Tensor | None:
        return self.segments[0].planes["scales"] if self.segments else self.fallback_scales

    @property
    def mins(self) -> torch.Tensor | None:
        return self.segments[0].planes.get("mins") if self.segments else None

    @property
    def takes_float32(self) -> bool:
        """Whether float32 rows run as they are, whatever the run dtype (a logits head is
        fed float32 then): Pagoda's kernel with no float weight kept for large batches."""
        return self.kernel == "pagoda" and self.dense_weight is None

    @classmethod
    def from_linear(cls, linear: Linear, method: str, **kwargs) -> QuantizedLinear:
        return cls(linear.weight, linear.bias, method, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        if self.dense_weight is not None and rows.shape[0] >= self.dense_from_rows:
            y = F.linear(rows, self.dense_weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.segments:  # Pagoda's kernel: the packed segment's (PackedLinear)
            return super().forward(x)
        rows = rows.contiguous()
        if self.kernel == "torch-int4":
            y = torch._weight_int4pack_mm_for_cpu(rows, self.fallback_codes, GROUP_K,
                                                  self.fallback_scales)
        else:
            y = F.linear(rows, self.fallback_codes)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.method}, "
            f"kernel={self.kernel}, dense_from_rows={self.dense_from_rows}"
        )


def packed_weight(format: str, shape: tuple[int, int],
                  planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> PackedWeight:
    """packing.pack's (codes, scales, mins) of an (out, in) weight as a PackedWeight."""
    codes, scales, mins = planes
    named = {"codes": codes, "scales": scales}
    if mins is not None:
        named["mins"] = mins
    return PackedWeight(format, *shape, named)


def quantize_linear_layers(
    model: nn.Module, method: str, dense_from_rows: int | None = DEFAULT_DENSE_FROM_ROWS
) -> nn.Module:
    """Replace every `Linear` / `MergedLinear` of a loaded model's decoder layers by a
    `QuantizedLinear` (`method`), and give the model an int8 logits head
    (`model.quantized_head`) where Pagoda's kernel runs it. Returns the model, changed in place."""
    num_linears = quantize_linears(model, method, dense_from_rows)
    num_linears += sum(isinstance(m, QuantizedLinear) for m in model.modules()) - num_linears
    head = model.logits_head_weight()
    head_note = "float logits head"
    if choose_kernel(HEAD_METHOD, head.dtype) == "pagoda":
        try:
            check_packable(*head.shape)
        except ValueError as error:
            head_note = f"float logits head ({error})"
        else:
            model.quantized_head = QuantizedLinear(head, model.logits_head_bias(), HEAD_METHOD,
                                                   dense_from_rows)
            head_note = f"{HEAD_METHOD} logits head"
    kernels = sorted({m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)})
    logger.info("%s weights in %d linear layers, %s, kernels %s (float weights from %s rows on)",
                method, num_linears, head_note, "/".join(kernels), dense_from_rows)
    return model


def quantize_linears(
    module: nn.Module, method: str, dense_from_rows: int | None = DEFAULT_DENSE_FROM_ROWS
) -> int:
    """Replace each `Linear` / `MergedLinear` under `module` (but a model's `lm_head`) by a
    `QuantizedLinear`, in place. A float weight the quantized layer does not keep is freed
    at once, even where a caller still holds its parameter (the loader's name table): the
    parameter is left empty. Returns the number replaced."""
    linears = [
        (name, child) for name, child in module.named_modules()
        if isinstance(child, Linear) and name != "lm_head"
    ]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        quantized = QuantizedLinear.from_linear(linear, method, dense_from_rows=dense_from_rows)
        setattr(parent, child_name, quantized)
        if quantized.dense_weight is None:
            linear.weight.data = linear.weight.data.new_empty(0)
    return len(linears)

"""Weight-only quantized linear layers (`--quantization int8|int4`), CPU only.

Weights are quantized once after loading, round-to-nearest; activations stay in the run
dtype and the kernel dequantizes weights on the fly (fewer bytes to stream per decode step):

    int8: symmetric per output channel  W[i, :] ~= scale[i] * q,  q in [-127, 127]
          torch._weight_int8pack_mm(x, q (out, in) int8, scale (out,))
    int4: asymmetric per group of GROUP_SIZE inputs, from the group's min and max
          W[i, g] ~= (q - 8) * scale[g, i] + zero[g, i],  q in [0, 15]
          torch._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)

GGUF Q4_1 stores blocks of 32 weights as d * q + m with q the block's 4-bit codes, and its
quantizer puts the block minimum at q = 0 and the maximum at q = 15. Re-quantizing such a
dequantized tensor with int4 groups of 32 finds the same min and max, hence scale = d and
zero = m + 8 d: the original codes come back, and the kernel multiplies by the weights the
GGUF file holds (to float rounding). `--quantization int4` on the bundled Q4_1 model is
therefore the GGUF model itself, kept quantized; on a float checkpoint it is ordinary
round-to-nearest int4.

The logits head keeps its float weight (in SmolLM2 the tied embedding table, Q8_0 in the
GGUF file): a per-channel int8 head is 2.5x faster at one row but costs 0.2 points of top-1
agreement with float32 on real text, and int4 weights keep only 97.1% with it, too close to
the 97% bar (tests/executor/test_fidelity.py).

Accuracy on the bundled model, teacher-forced against float32 (tests/executor/test_fidelity.py):
int4 + bf16 activations 97.3% top-1 agreement (bf16 alone: 97.3%); int8 96.1%, below the
97% bar: per-channel int8 cannot hold the per-block grid of Q4_1 weights exactly. int8 is
meant for float checkpoints; on a 4-bit GGUF model use int4.

Speed, microseconds per call, bf16 activations, 2-core AVX512-BF16 CPU without AMX, weight
576 -> 3072 (bf16 / int4 / int8): M = 1: 99 / 50 / 52; M = 8: 148 / 176 / 200; M = 32:
374 / 672 / 781. The kernels stream fewer weight bytes but do more work per multiply-add
than oneDNN's bf16 matmul, so they win for the rows of a decode step and lose from about 8
rows on. Each layer therefore keeps the float weight too and takes it from
`dense_from_rows` rows on (prefill, large batches): memory for speed, the right trade for a
small model on a CPU. Pass dense_from_rows=None for quantized weights only. With float32
activations the kernels have no fast path (10-80x slower than a float32 matmul), so
`load_model` warns.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import QUANTIZATION_METHODS
from pagoda.executor.layers.linear import Linear

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
"""int4 inputs per (scale, zero) pair; 32 is GGUF's Q4_1 block, see the docstring."""
INT4_INNER_K_TILES = 2
"""Packing parameter of the CPU int4 kernel (2, 4 or 8); 2 accepts any K % 32 == 0."""
DEFAULT_DENSE_FROM_ROWS = 8
"""From this many rows a step's matmul takes the float weight (see the docstring)."""


def check_quantization_supported(method: str, device: torch.device) -> None:
    """Raise ValueError where `method` cannot run on `device`."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
        )
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {method} runs on CPU only (PyTorch's packed CPU kernels), not on "
            f"{device}; use --device cpu or drop --quantization"
        )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float -> (codes (out, in) int8, scales (out,) float32)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,)
    codes = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float, in % GROUP_SIZE == 0 ->
    (codes (out, in) int32 in [0, 15], scales_and_zeros (in / GROUP_SIZE, out, 2) float32)."""
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(
            f"int4 needs input sizes divisible by {GROUP_SIZE}, this layer has {in_features}"
        )
    groups = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(dim=-1, keepdim=True)  # (out, G, 1)
    scales = ((groups.amax(dim=-1, keepdim=True) - low) / 15.0).clamp(min=1e-12)
    codes = ((groups - low) / scales).round().clamp(0, 15).to(torch.int32)
    zeros = low + 8 * scales  # the kernel computes (q - 8) * scale + zero
    scales_and_zeros = torch.cat((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return codes.reshape(out_features, in_features), scales_and_zeros


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W int8 or int4 (see the module docstring). Input (..., in) in the
    run dtype; output (..., out) in the same dtype.

    `dense_weight`: the float weight, used from `dense_from_rows` rows on (None: never)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        method: str,
        dense_from_rows: int | None = DEFAULT_DENSE_FROM_ROWS,
    ) -> None:
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError(f"quantized weights must be on the CPU, got {weight.device}")
        self.method = method
        self.out_features, self.in_features = weight.shape
        dtype = weight.dtype  # the run dtype: the kernels want scales in the input's dtype
        if method == "int8":
            codes, scales = quantize_int8(weight)
            self.register_buffer("codes", codes)
            self.register_buffer("scales", scales.to(dtype))
        elif method == "int4":
            codes, scales_and_zeros = quantize_int4(weight)
            self.register_buffer(
                "codes", torch._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
            )
            self.register_buffer("scales", scales_and_zeros.to(dtype))
        else:
            raise ValueError(f"unknown quantization method {method!r}")
        self.bias = bias
        self.dense_weight = weight if dense_from_rows is not None else None
        self.dense_from_rows = dense_from_rows

    @classmethod
    def from_linear(cls, linear: Linear, method: str, **kwargs) -> QuantizedLinear:
        return cls(linear.weight, linear.bias, method, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        if self.dense_weight is not None and rows.shape[0] >= self.dense_from_rows:
            y = F.linear(rows, self.dense_weight, self.bias)
        else:
            y = self._quantized_matmul(rows.contiguous())
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return torch._weight_int8pack_mm(rows, self.codes, self.scales)
        return torch._weight_int4pack_mm_for_cpu(rows, self.codes, GROUP_SIZE, self.scales)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.method}, "
            f"dense_from_rows={self.dense_from_rows}"
        )


def quantize_linear_layers(
    model: nn.Module, method: str, dense_from_rows: int | None = DEFAULT_DENSE_FROM_ROWS
) -> nn.Module:
    """Replace every `Linear` / `MergedLinear` of a loaded model's decoder layers by a
    `QuantizedLinear` (`method`); the logits head stays float (see the module docstring).
    Returns the model, changed in place."""
    linears = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, QuantizedLinear.from_linear(
            linear, method, dense_from_rows=dense_from_rows))
    logger.info("%s weights in %d linear layers (float weights from %s rows on)",
                method, len(linears), dense_from_rows)
    return model

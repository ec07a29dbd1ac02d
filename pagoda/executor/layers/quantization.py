"""Dynamic int8 linear layers (`--quantization int8`), CPU only.

Weights are quantized once, after loading: symmetric int8 per output channel (row i of W
gets scale max|W[i]| / 127, zero point 0), then prepacked for fbgemm / oneDNN. Activations
are quantized per call inside the kernel, with one scale for the whole (M, in) input, and
the result comes back in float32:

    x (M, in) run dtype -> float32 -> quantized.linear_dynamic -> (M, out) float32 -> run dtype

Activations stay in the run dtype (bfloat16 where the CPU has native bf16 matmuls): only
the linears change, and attention, norms and the KV cache keep half the bytes. Median
decode step, bundled model, 2-core AVX512-VNNI CPU, configurations interleaved in one
process: bf16 34 ms (batch 1) / 148 ms (batch 64); int8 + bf16 21 / 122 ms; int8 + float32
17 / 138 ms. So `--dtype float32` is the faster choice for a single stream, bf16 (with half
the KV-cache bytes) for batches of about 16 and up.

Accuracy is bounded by the activations, not the weights: weight-only int8 error is ~1%,
but one scale per input makes rows with outliers (the first token of a sequence carries
activations ~100x the rest) crush everything else to a few levels. Two measures help:
8-bit activations where VNNI makes them safe (`REDUCE_RANGE`), and quantizing outlier rows
apart. Even so, teacher-forced top-1 agreement with float32 on the bundled SmolLM2-135M is
~85% and perplexity rises ~6% (bf16 alone: 97%, 0%); without VNNI, 68% and 37%. See
tests/executor/test_fidelity.py.

The logits head sees M = rows sampled this step. Int8 wins by ~4x at M = 1 and loses to
bf16 above M of about 128, so `Int8LogitsHead` keeps the float weight too (for tied
embeddings it is the embedding table, which stays in float anyway) and picks by M.

These ops (`torch.ops.quantized.*`, quantized tensors) are deprecated upstream in favour
of torchao; torch 2.13 warns when a quantized tensor is created, and we silence exactly
that warning around the one place we create them.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.layers.linear import Linear

logger = logging.getLogger(__name__)

INT8_ENGINES = ("x86", "fbgemm", "onednn")
"""Quantized engines with a dynamic int8 linear kernel for x86 CPUs."""
OUTLIER_ROW_FACTOR = 4.0
"""Rows whose largest |x| passes this multiple of the median row's are quantized apart."""
DEFAULT_INT8_LOGITS_MAX_ROWS = 128
"""Above this many logit rows a bf16/fp16 head beats the int8 one (measured crossover
~128 on the AVX512-VNNI CPU; a float32 head never does, see `Int8LogitsHead`)."""


def _cpu_has_avx512_vnni() -> bool:
    try:
        return bool(torch.cpu._is_vnni_supported())
    except (AttributeError, RuntimeError):
        return False


REDUCE_RANGE = not _cpu_has_avx512_vnni()
"""7-bit activations. Needed where the kernel sums pairs of u8 x s8 products in int16 (AVX2:
255 * 127 * 2 saturates); VNNI accumulates in int32, and the 8th bit halves the error."""


def supported_quantized_engines() -> list[str]:
    return list(torch.backends.quantized.supported_engines)


def check_int8_supported(device: torch.device) -> None:
    """Raise ValueError where dynamic int8 linears cannot run."""
    if device.type != "cpu":
        raise ValueError(
            f"--quantization int8 runs on CPU only (fbgemm/oneDNN kernels), not on {device}; "
            "use --device cpu or drop --quantization"
        )
    engines = supported_quantized_engines()
    if not any(engine in engines for engine in INT8_ENGINES):
        raise ValueError(
            "--quantization int8 needs a torch build with the fbgemm, x86 or onednn quantized "
            f"engine; this one has {', '.join(engines) or 'none'}"
        )


def quantize_weight_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) float -> quantized qint8 tensor, symmetric per output channel."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # (out,)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch 2.13: "quantized tensor creation functions ... are deprecated" (see docstring).
        warnings.filterwarnings(
            "ignore", message=".*quantized tensor creation functions.*", category=UserWarning
        )
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)


class Int8DynamicLinear(nn.Module):
    """y = x W^T (+ b) with W in int8 (per-channel scales) and x quantized per call.

    Input (..., in_features) of any float dtype; output (..., out_features) in the input's
    dtype, or in `out_dtype` when given. Holds no float copy of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError(f"int8 weights must be on the CPU, got {weight.device}")
        self.out_features, self.in_features = weight.shape
        bias = None if bias is None else bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack(quantize_weight_int8(weight), bias)

    @classmethod
    def from_linear(cls, linear: Linear) -> Int8DynamicLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, in): kernel's dtype
        y = self._matmul(rows)  # (M, out) float32
        return y.view(*x.shape[:-1], self.out_features).to(out_dtype or x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel quantizes x with one scale for all its rows, so a row far larger than
        the others (the first token of a sequence carries activations 100x the rest) would
        leave the others a few int8 levels: such rows go through their own call."""
        if x.shape[0] > 1:
            row_max = x.abs().amax(dim=1)  # (M,); 5x faster here than vector_norm(inf)
            outliers = row_max > OUTLIER_ROW_FACTOR * row_max.median()
            if outliers.any():
                y = x.new_empty(x.shape[0], self.out_features)
                for rows in (outliers, ~outliers):
                    index = rows.nonzero().squeeze(1)
                    y[index] = self._kernel(x[index])
                return y
        return self._kernel(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, REDUCE_RANGE)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8LogitsHead(nn.Module):
    """hidden (n, hidden) -> float32 logits (n, vocab): int8 for n <= max_int8_rows, else a
    matmul with the float weight (kept: it is the tied embedding table, or the head's own)."""

    def __init__(self, weight: torch.Tensor, max_int8_rows: int | None) -> None:
        super().__init__()
        self.int8 = Int8DynamicLinear(weight, None)
        self.float_weight = weight  # (vocab, hidden), shared with the embedding when tied
        if weight.dtype == torch.float32:
            max_int8_rows = None  # int8 beats a float32 matmul at every M measured
        self.max_int8_rows = max_int8_rows  # None: always int8

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.max_int8_rows is None or hidden.shape[0] <= self.max_int8_rows:
            return self.int8(hidden, out_dtype=torch.float32)
        return F.linear(hidden, self.float_weight).float()


def quantize_linear_layers(
    model: nn.Module, int8_logits_max_rows: int | None = DEFAULT_INT8_LOGITS_MAX_ROWS
) -> nn.Module:
    """Replace every `Linear` / `MergedLinear` of a loaded model by an `Int8DynamicLinear`,
    and its logits head by an `Int8LogitsHead`; returns the model (changed in place).

    Expects the Llama-family layout: `model.lm_head` is a Linear, or None when tied to
    `model.model.embed_tokens` (the embedding itself stays in float)."""
    linears = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, Int8DynamicLinear.from_linear(linear))
    head = model.lm_head
    head_weight = model.model.embed_tokens.weight if head is None else head.weight
    model.lm_head = Int8LogitsHead(head_weight, int8_logits_max_rows)
    logger.info(
        "int8 dynamic quantization: %d linear layers and the logits head (int8 up to %s rows)",
        len(linears), "any number of" if model.lm_head.max_int8_rows is None else
        model.lm_head.max_int8_rows,
    )
    if REDUCE_RANGE:
        logger.warning(
            "this CPU has no AVX512-VNNI: int8 activations are limited to 7 bits, which costs "
            "accuracy (on SmolLM2-135M: 68%% top-1 agreement with float32 instead of 85%%)"
        )
    return model

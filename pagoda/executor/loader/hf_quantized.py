"""AWQ and GPTQ 4-bit Hugging Face checkpoints, loaded straight into Pagoda's packed int4.

Both formats store, per linear layer and per group of G inputs (G = group_size, a multiple
of 32), 4-bit codes q, a 4-bit zero point z and a float16 scale s, and mean

    w = s * (q - z) = s * q + (-s * z)

which is Pagoda's int4 form w = d * q + m (pagoda/executor/kernels/packing.py) with d = s and
m = -s * z, repeated over each 32-input sub-group of a G-group. So the codes are taken as
they are, never dequantized to float and quantized again, and no float copy of a quantized
weight is made. The one rounding: m = -s * z is computed in float32 and stored in float16
(relative error <= 2**-11 of s * z; tests/executor/test_awq_gptq.py measures it). Scales a
checkpoint stores in another float type are converted to float16.

Tensors per quantized linear (K inputs, N outputs), as the formats pack them:
- AWQ (quant_method "awq", version "gemm", zero_point true): qweight int32 (K, N/8) and
  qzeros int32 (K/G, N/8), 8 codes per int32 along the outputs in AWQ's interleaved order
  (nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]); scales (K/G, N).
- GPTQ (quant_method "gptq", desc_act false): qweight int32 (K/8, N), 8 codes along the
  inputs, low nibble first; qzeros int32 (K/G, N/8) along the outputs, low nibble first,
  holding z - 1 in the classic format (checkpoint_format "gptq", the default) and z in
  "gptq_v2"; scales (K/G, N); g_idx (K,) must be the plain input // G.

Refused with a ValueError naming the config field: other methods, bits != 4, group sizes
that are not a positive multiple of 32 (-1, one group per row, included), AWQ without zero
points or in another layout, GPTQ act-order (desc_act true). The checkpoint's other tensors
(embeddings, norms, the logits head) load in the run dtype as usual; the head stays float.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pagoda.executor.kernels.packing import GROUP_K, GroupQuantized, check_packable, pack
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.quantization import QuantizedLinear, choose_kernel, packed_weight
from pagoda.executor.loader.linear_parts import QuantizedLinearParts, linear_target

METHODS = ("awq", "gptq")
PARTS = ("qweight", "qzeros", "scales")
"""The tensors that make one quantized linear (GPTQ's g_idx is checked, then dropped)."""
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
"""AWQ packing: nibble i of an int32 holds output column 8c + AWQ_ORDER[i]."""
AWQ_COLUMN_NIBBLE = [AWQ_ORDER.index(j) for j in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]
PLAIN_ORDER = list(range(8))
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str
    """"awq" or "gptq"."""
    group_size: int
    zeros_minus_one: bool = False
    """GPTQ's classic format stores z - 1."""


DECODED_AT_LOAD = {"mxfp4": {"GptOssForCausalLM"}}
"""Checkpoint quantizations their model class decodes to float as it loads (gpt-oss's MXFP4
experts: models/gpt_oss.py), by the architectures that have them."""


def read_checkpoint_quantization(hf_config) -> CheckpointQuantization | None:
    """The checkpoint's own quantization (config.json `quantization_config`), or None;
    ValueError for a configuration Pagoda cannot run packed."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"config.json quantization_config.{field} = {config.get(field)!r}: {why}")

    method = str(config.get("quant_method", "")).lower()
    if method in DECODED_AT_LOAD:
        architectures = set(getattr(hf_config, "architectures", None) or [])
        if not architectures & DECODED_AT_LOAD[method]:
            raise refuse("quant_method", f"{method} checkpoints load for "
                         f"{', '.join(sorted(DECODED_AT_LOAD[method]))} only")
        return None
    if method not in METHODS:
        raise refuse("quant_method", "Pagoda loads awq and gptq quantized checkpoints (and "
                     "gpt-oss's mxfp4) only")
    if config.get("bits", config.get("w_bit")) != 4:
        raise refuse("bits", "only 4-bit AWQ/GPTQ checkpoints are supported")
    group_size = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group_size, int) or group_size <= 0 or group_size % GROUP_K:
        raise refuse("group_size", f"must be a positive multiple of {GROUP_K} (e.g. 32 or 128)")
    if method == "awq":
        if not config.get("zero_point", True):
            raise refuse("zero_point", "only AWQ with zero points is supported")
        if str(config.get("version", "gemm")).lower() != "gemm":
            raise refuse("version", "only AWQ's GEMM layout is supported")
        return CheckpointQuantization(method, group_size)
    if config.get("desc_act"):
        raise refuse("desc_act", "GPTQ act-order (desc_act true) is not supported")
    checkpoint_format = config.get("checkpoint_format") or "gptq"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", "only the gptq and gptq_v2 layouts are supported")
    return CheckpointQuantization(method, group_size, checkpoint_format == "gptq")


def resolve_checkpoint_quantization(
    quantization: str | None, quant: CheckpointQuantization, device: torch.device
) -> str:
    """An AWQ/GPTQ checkpoint runs in its own 4-bit form only: `quantization` auto or int4
    (both mean that), on the CPU. Anything else is refused: Pagoda neither dequantizes these
    checkpoints to float nor re-quantizes them to int8."""
    if quantization not in ("auto", "int4"):
        raise ValueError(
            f"this is a 4-bit {quant.method.upper()} checkpoint: it runs only in its own "
            f"4-bit form (quantization auto or int4), not quantization {quantization!r}"
        )
    if device.type != "cpu":
        raise ValueError(
            f"4-bit {quant.method.upper()} checkpoints run on CPU only (Pagoda's int4 "
            f"kernels are CPU kernels), not on {device}; use --device cpu"
        )
    return "int4"


def unpack_columns(packed: torch.Tensor, column_nibble: list[int]) -> torch.Tensor:
    """(R, C/8) int32 packed along columns -> (R, C) int16 codes; column 8c + j is nibble
    column_nibble[j] of packed[:, c]."""
    nibbles = (packed.to(torch.int32)[..., None] >> SHIFTS) & 15  # (R, C/8, 8), by nibble
    return nibbles[..., column_nibble].reshape(packed.shape[0], -1).to(torch.int16)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R/8, C) int32 packed along rows, low nibble first -> (R, C) int16 codes."""
    nibbles = (packed.to(torch.int32)[:, None, :] >> SHIFTS[:, None]) & 15  # (R/8, 8, C)
    return nibbles.reshape(-1, packed.shape[1]).to(torch.int16)


def to_group_quantized(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> GroupQuantized:
    """codes (N, K), scales and zeros (N, K/G) -> Pagoda's int4 groups of 32: d = s,
    m = -s * z rounded to float16, each repeated over the G/32 sub-groups of a group."""
    n, k = codes.shape
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape or k % group_size:
        raise ValueError(
            f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit codes "
            f"{tuple(codes.shape)} in groups of {group_size}"
        )
    check_packable(n, k)
    scales = scales.to(torch.float16)
    mins = (-scales.float() * zeros.float()).half()
    repeat = group_size // GROUP_K
    return GroupQuantized("q4", codes, scales.repeat_interleave(repeat, dim=1),
                          mins.repeat_interleave(repeat, dim=1))


def convert_linear(tensors: dict[str, torch.Tensor], quant: CheckpointQuantization) -> GroupQuantized:
    """One linear's checkpoint tensors (qweight, qzeros, scales) -> GroupQuantized (N, K)."""
    qweight, qzeros, scales = (tensors[part] for part in PARTS)
    if quant.method == "awq":
        codes = unpack_columns(qweight, AWQ_COLUMN_NIBBLE).T  # (K, N) -> (N, K)
        zeros = unpack_columns(qzeros, AWQ_COLUMN_NIBBLE)
    else:
        codes = unpack_rows(qweight).T
        zeros = unpack_columns(qzeros, PLAIN_ORDER) + int(quant.zeros_minus_one)
    return to_group_quantized(codes.contiguous(), scales.T, zeros.T, quant.group_size)


def check_g_idx(name: str, g_idx: torch.Tensor, group_size: int) -> None:
    plain = torch.arange(g_idx.numel()) // group_size
    if not torch.equal(g_idx.long().flatten(), plain):
        raise ValueError(f"{name}: permuted groups (act-order) are not supported")


class PrepackedInt4Linear(QuantizedLinear):
    """A QuantizedLinear (int4) made from codes and scales a checkpoint already holds, with
    no float weight: Pagoda's kernel where it runs the dtype, else PyTorch's int4 kernel."""

    def __init__(self, quantized: GroupQuantized, bias: torch.Tensor | None, dtype: torch.dtype
                 ) -> None:
        shape = quantized.codes.shape
        check_packable(*shape)
        kernel = choose_kernel("int4", dtype)
        if kernel == "pagoda":
            self._init_layer("int4", kernel, shape, bias,
                             packed=packed_weight("q4", shape, pack(quantized)))
        else:
            self._init_layer("int4", kernel, shape, bias, fallback=quantized, dtype=dtype)


def _prepacked_linear(module: Linear, parts: list[GroupQuantized], dtype: torch.dtype
                      ) -> nn.Module:
    quantized = GroupQuantized(
        "q4", *(torch.cat([getattr(p, field) for p in parts])
                for field in ("codes", "scales", "mins")))
    return PrepackedInt4Linear(quantized, module.bias, dtype)


class PrequantizedLoader:
    """Feeds a model's load_weights, taking the quantized linears' tensors out of the stream.

    Built before load_weights starts: the float weight of every linear the checkpoint
    quantizes is dropped (linear_parts.py). Each checkpoint linear is converted as soon as
    its tensors are all in, and its module becomes a PrepackedInt4Linear when its last part
    is, the parts concatenated along the outputs (its bias, loaded by load_weights, is
    shared). `finish` checks nothing is missing."""

    def __init__(self, model: nn.Module, names: list[str], quant: CheckpointQuantization,
                 dtype: torch.dtype) -> None:
        self.quant, self.dtype = quant, dtype
        targets = {prefix: linear_target(model, prefix)
                   for prefix, _, suffix in (name.rpartition(".") for name in names)
                   if suffix == "qweight"}
        # a plain function, not a bound method (which would make the loader a reference cycle)
        self.linears = QuantizedLinearParts(model, targets, partial(_prepacked_linear, dtype=dtype))
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # HF linear -> its tensors

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """`stream`: the checkpoint's tensors as stored; yields the others in the run dtype."""
        targets = self.linears.targets
        for name, tensor in stream:
            prefix, _, suffix = name.rpartition(".")
            if prefix in targets and suffix == "g_idx":
                check_g_idx(name, tensor, self.quant.group_size)
            elif prefix in targets and suffix in PARTS:
                self._take(prefix, suffix, tensor)
            else:
                yield name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def _take(self, prefix: str, suffix: str, tensor: torch.Tensor) -> None:
        tensors = self.pending.setdefault(prefix, {})
        tensors[suffix] = tensor
        if len(tensors) < len(PARTS):
            return
        del self.pending[prefix]
        try:
            self.linears.add(prefix, convert_linear(tensors, self.quant))
        except ValueError as error:
            raise ValueError(f"{prefix}: {error}") from None

    def finish(self) -> None:
        """After load_weights: every quantized linear must have been completed."""
        missing = [f"{p} ({', '.join(t for t in PARTS if t not in got)})"
                   for p, got in self.pending.items()]
        missing += self.linears.missing()
        if missing:
            raise ValueError(f"quantized checkpoint lacks tensors of: {', '.join(missing[:8])}")

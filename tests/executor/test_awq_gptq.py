"""AWQ and GPTQ 4-bit checkpoints (pagoda/executor/loader/hf_quantized.py): a tiny Llama
quantized here, packed by the formats' own rules (helpers below, written after AutoAWQ's and
AutoGPTQ's packers, independent of the loader's unpacking), loaded packed by Pagoda and
compared with transformers running the dequantized weights s * (q - z) in float32, and with
the same weights but the offset -s*z rounded to float16 as Pagoda stores it."""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.config import CacheConfig
from pagoda.executor.layers import quantization
from pagoda.executor.layers.linear import Linear
from pagoda.executor.loader.hf_quantized import (
    PrepackedInt4Linear,
    convert_linear,
    read_checkpoint_quantization,
)
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint, resolve_quantization
from pagoda.executor.model_runner import ModelRunner
from tests.executor.test_model_parity import PROMPTS
from tests.executor.tiny_checkpoints import build_checkpoint

SIZES = {"hidden_size": 128, "intermediate_size": 256}
"""Inputs of 128 and 256: room for groups of 128."""
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
"""AutoAWQ's pack order: nibble i of an int32 holds output column 8c + AWQ_ORDER[i]."""
FORMATS = {  # name -> quantization_config
    "awq": {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
}
EXACT_TOLERANCE = 5e-3
"""Max |ours - reference| / max |reference| over the prompt logits against s * (q - z): the
float16 offsets m = -s*z cost up to 1.9e-3 on this model (weights ~N(0, 0.2), 2 layers)."""
ROUNDED_TOLERANCE = 1e-5
"""The same against s * q + float16(-s * z): float32 summation order only (measured 1e-6)."""


def quantize(weight: torch.Tensor, group_size: int, lowest_zero: int):
    """(N, K) -> codes q (N, K), zeros z and float16 scales s (N, K/G): asymmetric min/max."""
    n, k = weight.shape
    groups = weight.view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).half()
    zeros = (-low / scales.float()).round().clamp(lowest_zero, 15)
    codes = ((groups / scales.float()[..., None]).round() + zeros[..., None]).clamp(0, 15)
    return codes.view(n, k).int(), zeros.int(), scales


def dequantize(codes, zeros, scales, group_size: int, rounded: bool = False) -> torch.Tensor:
    """s * (q - z), float32, exactly; `rounded`: s * q + float16(-s * z) as Pagoda holds it."""
    n, k = codes.shape
    groups, s = codes.view(n, k // group_size, group_size).float(), scales.float()[..., None]
    if rounded:
        return (groups * s + (-s * zeros.float()[..., None]).half().float()).view(n, k)
    return ((groups - zeros.float()[..., None]) * s).view(n, k)


def pack_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(R, C) ints -> (R, C/8) int32: nibble i of packed[:, c] is values[:, 8c + order[i]]."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for i, column in enumerate(order):
        packed |= values[:, column::8].int() << (4 * i)
    return packed


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """(R, C) ints -> (R/8, C) int32: nibble j of packed[r] is values[8r + j] (GPTQ)."""
    packed = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int32)
    for j in range(8):
        packed |= values[j::8].int() << (4 * j)
    return packed


def checkpoint_tensors(fmt: str, codes, zeros, scales, group_size: int) -> dict:
    """One linear's tensors in `fmt` (codes (N, K); zeros, scales (N, K/G))."""
    if fmt == "awq":
        return {"qweight": pack_columns(codes.T, AWQ_ORDER),
                "qzeros": pack_columns(zeros.T, AWQ_ORDER), "scales": scales.T.contiguous()}
    stored_zeros = zeros - 1 if fmt == "gptq" else zeros  # classic GPTQ stores z - 1
    k = codes.shape[1]
    return {"qweight": pack_rows(codes.T), "qzeros": pack_columns(stored_zeros.T, list(range(8))),
            "scales": scales.T.contiguous(),
            "g_idx": (torch.arange(k) // group_size).int()}


def quantized_checkpoint(folder: str, fmt: str, group_size: int, **overrides):
    """Write a tiny Llama in `fmt` to `folder` (config fields `overrides` changed); returns
    transformers' model holding the dequantized weights (the reference), and one with the
    offsets rounded to float16."""
    model = build_checkpoint("llama", folder, **{**SIZES, **overrides})
    rounded = copy.deepcopy(model)
    rounded_params = rounded.state_dict()
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(folder, name))
    tensors = {}
    for name, param in model.state_dict().items():
        if ".layers." in name and name.endswith("_proj.weight"):
            codes, zeros, scales = quantize(param, group_size, lowest_zero=1)
            prefix = name.removesuffix(".weight")
            for part, tensor in checkpoint_tensors(fmt, codes, zeros, scales, group_size).items():
                tensors[f"{prefix}.{part}"] = tensor
            with torch.no_grad():
                param.copy_(dequantize(codes, zeros, scales, group_size))
                rounded_params[name].copy_(dequantize(codes, zeros, scales, group_size, True))
        else:
            tensors[name] = param.detach().clone().contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**FORMATS[fmt], "group_size": group_size}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return model, rounded


def relative_error(ours: torch.Tensor, reference: torch.nn.Module, prompt: list[int]) -> float:
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def load(folder: str, quantization_choice: str | None = "auto") -> torch.nn.Module:
    checkpoint = open_checkpoint(resolve_model_files(folder))
    return load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=256,
                      quantization=quantization_choice)


def prompt_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    return runner.prompt_logits(PROMPTS)


@pytest.mark.parametrize("group_size", [128, 32])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_checkpoint_runs_packed_and_matches_its_dequantized_weights(tmp_path, fmt, group_size):
    exact, rounded = quantized_checkpoint(str(tmp_path), fmt, group_size)
    model = load(str(tmp_path))
    linears = [m for m in model.model.layers.modules() if isinstance(m, Linear | PrepackedInt4Linear)]
    assert len(linears) == 4 * 2 and all(type(m) is PrepackedInt4Linear for m in linears)
    assert {m.kernel for m in linears} == {"pagoda"}  # float32 runs Pagoda's kernel everywhere
    assert all(m.dense_weight is None for m in linears) and model.quantized_head is None
    assert not [n for n, p in model.named_parameters() if n.endswith("proj.weight")]
    for prompt, ours in zip(PROMPTS, prompt_logits(model)):
        assert relative_error(ours, rounded, prompt) < ROUNDED_TOLERANCE
        assert relative_error(ours, exact, prompt) < EXACT_TOLERANCE


def test_pytorch_int4_kernel_where_pagodas_does_not_build(tmp_path, monkeypatch):
    monkeypatch.setattr(quantization, "kernels_available", lambda dtype=None: False)
    exact, rounded = quantized_checkpoint(str(tmp_path), "awq", 128)
    model = load(str(tmp_path), "int4")  # int4 means the checkpoint's own form too
    kernels = {m.kernel for m in model.modules() if isinstance(m, PrepackedInt4Linear)}
    assert kernels == {"torch-int4"}
    ours = prompt_logits(model)[0]
    assert relative_error(ours, rounded, PROMPTS[0]) < 1e-4  # PyTorch's (q - 8) * d + (m + 8d)
    assert relative_error(ours, exact, PROMPTS[0]) < EXACT_TOLERANCE


@pytest.mark.parametrize("group_size", [128, 32])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_conversion_keeps_the_codes_and_rounds_only_the_offsets(fmt, group_size):
    """Codes and scales come over exactly; m = -s*z is float16-rounded: error <= 2**-11 |s z|."""
    torch.manual_seed(0)
    weight = torch.randn(48, 256)
    codes, zeros, scales = quantize(weight, group_size, lowest_zero=0 if fmt != "gptq" else 1)
    tensors = checkpoint_tensors(fmt, codes, zeros, scales, group_size)
    quant = read_checkpoint_quantization(
        SimpleNamespace(quantization_config={**FORMATS[fmt], "group_size": group_size}))
    converted = convert_linear(tensors, quant)
    repeat = group_size // 32
    assert torch.equal(converted.codes.int(), codes)
    assert torch.equal(converted.scales, scales.repeat_interleave(repeat, dim=1))
    exact = dequantize(codes, zeros, scales, group_size)
    offsets = (scales.float() * zeros.float()).abs().repeat_interleave(group_size, dim=1)
    error = (converted.dequantize() - exact).abs()
    assert (error <= offsets * 2**-11 + 1e-7).all()
    assert error.max() > 0  # the rounding is real, and measured here


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(quantization_config={**FORMATS["gptq"], "group_size": 128, **fields})


@pytest.mark.parametrize(("fields", "message"), [
    ({"bits": 8}, "quantization_config.bits = 8"),
    ({"group_size": -1}, "quantization_config.group_size = -1"),
    ({"group_size": 48}, "quantization_config.group_size = 48"),
    ({"desc_act": True}, "quantization_config.desc_act = True"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method = 'bitsandbytes'"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format = 'marlin'"),
    ({**FORMATS["awq"], "version": "gemv"}, "quantization_config.version = 'gemv'"),
    ({**FORMATS["awq"], "zero_point": False}, "quantization_config.zero_point = False"),
])
def test_unsupported_configs_are_refused_by_field(fields, message):
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(config(**fields))
    assert read_checkpoint_quantization(SimpleNamespace()) is None


def test_other_quantization_choices_and_devices_are_refused(tmp_path):
    quantized_checkpoint(str(tmp_path), "gptq", 32)
    checkpoint = open_checkpoint(resolve_model_files(str(tmp_path)))
    cpu = torch.device("cpu")
    for choice in ("auto", "int4"):
        assert resolve_quantization(choice, checkpoint, cpu) == "int4"
    for choice in ("int8", "none", None):
        with pytest.raises(ValueError, match="4-bit GPTQ checkpoint: it runs only in its own"):
            resolve_quantization(choice, checkpoint, cpu)
    with pytest.raises(ValueError, match="run on CPU only.*meta"):
        resolve_quantization("auto", checkpoint, torch.device("meta"))


def test_act_order_g_idx_is_refused(tmp_path):
    quantized_checkpoint(str(tmp_path), "gptq", 32)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj.g_idx: permuted groups"):
        load(str(tmp_path))

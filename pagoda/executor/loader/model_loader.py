"""Open a checkpoint, build the model for its architecture, fill it, put it on the device."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagoda.executor.layers.quantization import check_int8_supported, quantize_linear_layers
from pagoda.executor.loader.gguf_loader import GGUFCheckpoint
from pagoda.executor.loader.model_files import ModelFiles
from pagoda.executor.loader.safetensors_loader import SafetensorsCheckpoint
from pagoda.executor.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def cpu_has_fast_bfloat16() -> bool:
    """True where oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, and on CPUs with native bf16 matmuls (measured on the
    AMX machine in BENCHMARKS.md: 2.2x batched decode throughput, 1.7x single-stream
    decode, half the prefill time of float32); float32 on other CPUs."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bfloat16():
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]


def open_checkpoint(files: ModelFiles) -> GGUFCheckpoint | SafetensorsCheckpoint:
    if files.format == "gguf":
        return GGUFCheckpoint(files.path)
    return SafetensorsCheckpoint(files.path)


def load_model(
    checkpoint: GGUFCheckpoint | SafetensorsCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quantization: str | None = None,
) -> nn.Module:
    """Build and fill the model; with quantization "int8" its linear layers are then replaced
    by dynamic int8 ones (see pagoda/executor/layers/quantization.py)."""
    if quantization == "int8":
        check_int8_supported(device)  # before the slow load
    model_class = resolve_model_class(checkpoint.hf_config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(checkpoint.hf_config, max_position=max_position)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.load_weights(checkpoint.iter_weights(dtype))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())  # before int8 weights leave them
    if quantization == "int8":
        quantize_linear_layers(model)
    logger.info(
        "loaded %s (%.1fM parameters, %s%s) on %s",
        type(model).__name__, num_params / 1e6, str(dtype).removeprefix("torch."),
        f", {quantization} linears" if quantization else "", device,
    )
    return model

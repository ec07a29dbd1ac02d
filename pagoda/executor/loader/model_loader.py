"""Open a checkpoint, build the model for its architecture, fill it, put it on the device."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator

import torch
from torch import nn

from pagoda.child_process import threads_per_process
from pagoda.executor.kernels.build import load_cpu_kernels
from pagoda.executor.layers.packed_linear import PackedLinear
from pagoda.executor.layers.quantization import (
    QuantizedLinear,
    check_quantization_supported,
    choose_kernel,
    quantize_linear_layers,
    quantize_linears,
)
from pagoda.executor.loader.gguf_loader import GGUFCheckpoint
from pagoda.executor.loader.gguf_packed import PackedGGUFLoader
from pagoda.executor.loader.heap import release_freed_memory
from pagoda.executor.loader.hf_quantized import (
    CheckpointQuantization,
    PrequantizedLoader,
    read_checkpoint_quantization,
    resolve_checkpoint_quantization,
)
from pagoda.executor.loader.model_files import ModelFiles
from pagoda.executor.loader.safetensors_loader import SafetensorsCheckpoint
from pagoda.executor.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
"""Hugging Face names of decoder-layer tensors: model.layers.{i}.<...>"""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def set_cpu_threads(num_ranks: int = 1) -> int:
    """Intra-op threads = the CPUs this process may run on (its affinity mask, which taskset
    and container cpusets narrow), divided among `num_ranks` processes sharing them (the
    ranks of a tensor-parallel group on one machine), set once per engine; OMP_NUM_THREADS,
    when set, wins. Returns the number in use."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_process(num_ranks))
    return torch.get_num_threads()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; float32 on every CPU, in prefill and in decode.

    Measured per phase on each CPU kind (BENCHMARKS.md): where Pagoda's bf16
    kernels run (AVX-512 BF16, AMX) float32 activations over the file's own packed types are
    as fast or faster in decode (the kernels stream the same packed bytes; bf16 adds
    conversions) and within a few percent in prefill, and bf16 is the coarser mode (its
    rounding made exact ties of the bundled model's first answer token); AVX2, AVX-512F
    without BF16 and ARM have no native bf16 arithmetic at all. `--dtype bfloat16` still
    runs the bf16 kernels where the CPU has them."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def open_checkpoint(files: ModelFiles) -> GGUFCheckpoint | SafetensorsCheckpoint:
    if files.format == "gguf":
        return GGUFCheckpoint(files.path)
    return SafetensorsCheckpoint(files.path)


def checkpoint_quantization(
    checkpoint: GGUFCheckpoint | SafetensorsCheckpoint,
) -> CheckpointQuantization | None:
    """A Hugging Face folder's own AWQ/GPTQ quantization (pagoda/executor/loader/hf_quantized.py)."""
    if isinstance(checkpoint, SafetensorsCheckpoint):
        return read_checkpoint_quantization(checkpoint.hf_config)
    return None


GGUF_OWN_TYPES = "gguf"
"""What auto resolves to for a GGUF file on a CPU with Pagoda's kernels: each quantized
matrix runs packed in the file's own type (pagoda/executor/loader/gguf_packed.py)."""


def resolve_quantization(
    quantization: str | None,
    checkpoint: GGUFCheckpoint | SafetensorsCheckpoint,
    device: torch.device,
) -> str | None:
    """The method to apply, or None. "auto" is GGUF_OWN_TYPES for a GGUF file on a CPU where
    Pagoda's kernels build: its quantized weights run packed as the file stores them, as
    llama.cpp runs them (float32 activations on every CPU; bf16 through the bf16 kernels
    where the CPU has them, for the types they take). Anything else under auto stays in the
    run dtype; "none" dequantizes a GGUF file to float; int8/int4 quantize float weights
    (pagoda/executor/layers/quantization.py). An AWQ/GPTQ checkpoint runs its own 4-bit
    weights: "int4" under auto or int4, anything else refused
    (`resolve_checkpoint_quantization`)."""
    quant = checkpoint_quantization(checkpoint)
    if quant is not None:
        return resolve_checkpoint_quantization(quantization, quant, device)
    if quantization in (None, "none"):
        return None
    if quantization != "auto":
        return quantization
    # device first: elsewhere, do not build the kernels
    if device.type == "cpu" and isinstance(checkpoint, GGUFCheckpoint) and load_cpu_kernels():
        logger.info("auto quantization: the GGUF file's own quantized types, run packed "
                    "(--quantization none for float weights)")
        return GGUF_OWN_TYPES
    return None


def weight_formats(model: nn.Module) -> str | None:
    """What the model's linears hold, for the start-up log: e.g. "int4", "packed q4k/q5/q6k"
    (a GGUF file's own types), or None for float weights."""
    method = next((m.method for m in model.modules() if isinstance(m, QuantizedLinear)), None)
    if method is not None:
        return method
    packed = sorted({f for m in model.modules() if isinstance(m, PackedLinear) for f in m.formats})
    return "packed " + "/".join(packed) if packed else None


def quantize_layers_as_loaded(
    weights: Iterator[tuple[str, torch.Tensor]], names: list[str], model: nn.Module, method: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the checkpoint's tensors (`names`: all of their names, in the same order) on to
    load_weights, and quantize each decoder layer's linears, freeing their float weights, as
    soon as the last tensor of that layer has been loaded: loading never holds the whole
    float model (the RSS peak). Any order of tensors works (a sharded checkpoint may split a
    layer between files)."""
    last_index = {}  # layer -> index of its last tensor
    for index, name in enumerate(names):
        match = LAYER_NAME.match(name)
        if match:
            last_index[int(match.group(1))] = index
    layer_of_last = {index: layer for layer, index in last_index.items()}
    layers = model.model.layers
    for index, item in enumerate(weights):
        yield item  # load_weights asks for the next tensor once this one is in place
        if index in layer_of_last:
            quantize_linears(layers[layer_of_last[index]], method)
            release_freed_memory()


def load_model(
    checkpoint: GGUFCheckpoint | SafetensorsCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quantization: str | None = None,
) -> nn.Module:
    """Build and fill the model; with quantization "int8" or "int4" its linear layers are
    then replaced by weight-only quantized ones (see pagoda/executor/layers/quantization.py).
    Under "auto" (see `resolve_quantization`) a GGUF file's quantized matrices load packed in
    their own types as they stream in, embedding and head included, and an AWQ/GPTQ
    checkpoint's linears from its own codes (its logits head stays float)."""
    quantization = resolve_quantization(quantization, checkpoint, device)
    if quantization not in (None, GGUF_OWN_TYPES):
        check_quantization_supported(quantization, device)  # before the slow load
    model_class = resolve_model_class(checkpoint.hf_config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(checkpoint.hf_config, max_position=max_position)
    finally:
        torch.set_default_dtype(previous_dtype)
    num_params = sum(p.numel() for p in model.parameters())
    quant = checkpoint_quantization(checkpoint)
    prequantized = None if quant is None else PrequantizedLoader(
        model, checkpoint.tensor_names(), quant, dtype)
    if quantization == GGUF_OWN_TYPES:
        prequantized = PackedGGUFLoader(model, checkpoint, dtype)
        weights = prequantized.weights(dtype)
    elif prequantized is not None:
        weights = prequantized.weights(checkpoint.iter_weights(None))
    elif quantization is not None:
        weights = quantize_layers_as_loaded(checkpoint.iter_weights(dtype),
                                            checkpoint.tensor_names(), model, quantization)
    else:
        weights = checkpoint.iter_weights(dtype)
    model.load_weights(weights)
    model.eval()
    if prequantized is not None:
        prequantized.finish()
    elif quantization is not None:
        quantize_linear_layers(model, quantization)  # layers not done while loading, the head
    if quantization is not None:
        release_freed_memory()
        if quantization != GGUF_OWN_TYPES and choose_kernel(quantization, dtype) != "pagoda":
            logger.warning(
                "--quantization %s with %s activations runs PyTorch's kernels (int8: no "
                "speed-up); Pagoda's quantized kernels take float32 (and bfloat16 on CPUs "
                "with AVX-512 BF16): use --dtype float32",
                quantization, str(dtype).removeprefix("torch."),
            )
    logger.info(
        "loaded %s (%.1fM parameters, %s%s) on %s",
        type(model).__name__, num_params / 1e6, str(dtype).removeprefix("torch."),
        f", {quantization} linears" if quantization else "", device,
    )
    return model

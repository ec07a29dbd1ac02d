"""An adapter's A/B matrices as tensors, keyed (layer, target), from the files that
pagoda/lora/adapter_files.py read the headers of.

B comes pre-multiplied by the module's scale, so a module's delta is (x @ a^T) @ b^T and no
scale travels further. For a GGUF adapter of a `llama` file, the rows of attn_q / attn_k's
lora_b are in llama.cpp's rotary order (convert_lora_to_gguf.py permutes B exactly as
convert_hf_to_gguf.py permutes the base q/k weights, and A not at all): they are un-permuted
with the GGUF loader's own unpermute_rotary, so the pairs equal the PEFT adapter's.

Storage dtype (--lora-dtype): "auto" keeps the file's own numbers where every tensor of the
adapter is float32, bfloat16 or float16 (a GGUF F32 / F16 / BF16 file likewise), so a loaded
adapter holds its file's size; anything else (mixed dtypes, a quantized GGUF such as q8_0)
becomes float32. B's scale is applied in float32 before B is stored in that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from pagoda.executor.loader.gguf_architectures import PERMUTED_QK_ARCHITECTURES, unpermute_rotary
from pagoda.executor.loader.gguf_dequant import dequantize_tensor
from pagoda.executor.loader.gguf_reader import CompactGGUFReader
from pagoda.lora.adapter_files import AdapterFiles, AdapterModule, LoRAAdapterError


@dataclass
class LoRAPair:
    """One adapted projection: delta = (x @ a^T) @ b^T."""

    a: torch.Tensor
    """(rank, in_features), contiguous."""
    b: torch.Tensor
    """(out_features, rank), contiguous, already multiplied by the module's scale."""


STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""--lora-dtype's names (besides auto) -> the dtype loaded adapters are stored in."""


def storage_dtype_of(lora_dtype: str | torch.dtype, file_dtypes: set) -> torch.dtype:
    """The dtype an adapter whose tensors are `file_dtypes` in its file (None: a quantized
    GGUF type) is stored in under `lora_dtype` ("auto", a STORAGE name or a torch dtype)."""
    if isinstance(lora_dtype, torch.dtype):
        return lora_dtype
    if lora_dtype != "auto":
        return STORAGE[lora_dtype]
    if len(file_dtypes) == 1 and next(iter(file_dtypes)) in STORAGE.values():
        return next(iter(file_dtypes))
    return torch.float32


def load_lora_weights(
    adapter: AdapterFiles, dtype: str | torch.dtype = "auto", base_config: Any = None,
) -> dict[tuple[int, str], LoRAPair]:
    """(layer, target) -> LoRAPair for every module of `adapter`, in `dtype` ("auto": the
    file's own where it is float32 / bfloat16 / float16, else float32; a STORAGE name or a
    torch dtype: that). `base_config` (the base model's HF config) is needed only for a GGUF
    adapter of a `llama` file (its q/k head counts undo the rotary permutation);
    LoRAAdapterError where it is missing then."""
    if adapter.format == "peft":
        raw = _read_safetensors(adapter)
        file_dtypes = {t.dtype for pair in raw for t in pair}
    else:
        raw, file_dtypes = _read_gguf(adapter, base_config)
    dtype = storage_dtype_of(dtype, file_dtypes)
    pairs = {}
    for module, (a, b) in zip(adapter.modules, raw):
        if tuple(a.shape) != (module.rank, module.in_features) or \
                tuple(b.shape) != (module.out_features, module.rank):
            raise LoRAAdapterError(
                f"LoRA adapter {adapter.path!r}: layer {module.layer} {module.target}'s tensors "
                f"are {tuple(a.shape)} and {tuple(b.shape)}, not as its header said")
        b = b.to(torch.float32) * module.scale
        pairs[(module.layer, module.target)] = LoRAPair(
            a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return pairs


def _read_safetensors(adapter: AdapterFiles) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        with safe_open(adapter.weights_path, framework="pt", device="cpu") as f:
            return [(f.get_tensor(m.a_name), f.get_tensor(m.b_name)) for m in adapter.modules]
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter {adapter.path!r} cannot be read: {e}") from None


def _read_gguf(adapter: AdapterFiles, base_config: Any
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], set]:
    """The pairs in float32 (exact for F32 / F16 / BF16 tensors) and the file's dtypes
    (None for a quantized type)."""
    try:
        reader = CompactGGUFReader(adapter.weights_path, "r")
    except Exception as e:  # noqa: BLE001 -- the reader raises many kinds on a damaged file
        raise LoRAAdapterError(
            f"LoRA adapter {adapter.path!r}: damaged GGUF file ({type(e).__name__}: {e})"
        ) from None
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> torch.Tensor:
        tensor = tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return dequantize_tensor(np.asarray(tensor.data), tensor.tensor_type, shape,
                                 torch.float32)

    permuted = adapter.architecture in PERMUTED_QK_ARCHITECTURES
    loaded, file_dtypes = [], set()
    for module in adapter.modules:
        a, b = read(module.a_name), read(module.b_name)
        if permuted and module.target in ("q_proj", "k_proj"):
            b = unpermute_rotary(b, _head_count(adapter, module, base_config))
        loaded.append((a, b))
        file_dtypes |= {GGUF_STORAGE.get(int(tensors[name].tensor_type))
                        for name in (module.a_name, module.b_name)}
    return loaded, file_dtypes


GGUF_STORAGE = {gguf.GGMLQuantizationType.F32: torch.float32,
                gguf.GGMLQuantizationType.F16: torch.float16,
                gguf.GGMLQuantizationType.BF16: torch.bfloat16}
"""GGML type (F32, F16, BF16) -> the torch dtype holding it exactly; quantized types: none."""


def _head_count(adapter: AdapterFiles, module: AdapterModule, base_config: Any) -> int:
    """The heads of q_proj (attention) or k_proj (key/value) the base model has: the rows of
    B are permuted within each head."""
    if base_config is None:
        raise LoRAAdapterError(
            f"LoRA adapter {adapter.path!r}: a `{adapter.architecture}` GGUF adapter needs "
            "the base model's config to undo llama.cpp's q/k permutation")
    config = base_config.get_text_config() if hasattr(base_config, "get_text_config") \
        else base_config

    def get(key: str):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    heads = int(get("num_attention_heads"))
    if module.target == "k_proj":
        heads = int(get("num_key_value_heads") or heads)
    if module.out_features % heads or (module.out_features // heads) % 2:
        raise LoRAAdapterError(
            f"LoRA adapter {adapter.path!r}: layer {module.layer} {module.target} has "
            f"{module.out_features} rows, not whole heads of the base's {heads}")
    return heads

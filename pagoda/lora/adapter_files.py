"""What a LoRA adapter's files hold, read from their headers only: no torch, no weights read.

Two forms, as users have them:

  PEFT     a folder: adapter_config.json + adapter_model.safetensors, tensors
           `base_model.model.<module path>.lora_A.weight` (r, in) and `.lora_B.weight`
           (out, r); scale = alpha / r (alpha / sqrt(r) with use_rslora), alpha and r per
           module through alpha_pattern / rank_pattern (PEFT's own matching rule).
  GGUF     one file written by llama.cpp's convert_lora_to_gguf.py: `general.type = adapter`,
           `adapter.type = lora`, `adapter.lora.alpha`; tensors `blk.N.<part>.weight.lora_a`
           (r, in) and `.lora_b` (out, r); scale = alpha / r as llama.cpp computes it (1 when
           alpha is 0). For a `llama` file the lora_b rows of attn_q / attn_k are in
           llama.cpp's rotary order: executor/lora/adapter_weights.py undoes it.

Only the seven linear projections of a decoder layer may be targets (TARGETS); anything else
(embeddings, lm_head, norms, modules_to_save, DoRA, biases, ...) is refused with a
LoRAAdapterError naming the problem: an adapter is served exactly or not at all.
`check_adapter` (adapter_fit.py) then holds it against the base model's config and
--max-lora-rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Literal

from pagoda.lora.gguf_header import GGUF_MAGIC, GGUFHeaderError, read_gguf_header

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, PEFT's names, in a layer's order."""
GGUF_TARGETS = {
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}
"""llama.cpp's tensor names of the seven targets."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
"""Element sizes of the safetensors dtypes read (the weights are cast to float on load)."""
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024

_PEFT_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
"""A PEFT LoRA tensor: the module's path in the model, A or B."""
_PEFT_MODULE = re.compile(
    r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(?P<layer>\d+)\."
    r"(?:self_attn\.(?P<attn>[qkvo]_proj)|mlp\.(?P<mlp>gate_proj|up_proj|down_proj))$")
"""A projection of decoder layer N, as PEFT names it over a CausalLM (`model.layers.N.
self_attn.q_proj`), a bare decoder (`layers.N...`) or a multimodal model's language model
(`model.language_model.layers.N...`); nothing deeper: an MoE expert's gate_proj
(`mlp.experts.E.gate_proj`) or a vision tower's q_proj is not a layer's projection."""
_GGUF_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight\.lora_(?P<ab>[ab])$")


class LoRAAdapterError(ValueError):
    """An adapter that is missing, unreadable, not a LoRA, or one Pagoda cannot serve exactly
    (a target other than the seven projections, DoRA, ...), or that does not fit the base."""


@dataclass
class AdapterModule:
    """One adapted projection: y += scale * (x @ A^T) @ B^T, A (rank, in_features),
    B (out_features, rank)."""

    layer: int
    target: str
    """One of TARGETS."""
    rank: int
    in_features: int
    out_features: int
    scale: float
    a_name: str = ""
    """The tensor names of A and B in the weights file."""
    b_name: str = ""


@dataclass
class AdapterFiles:
    """An adapter as read from its files: its modules sorted by (layer, TARGETS order)."""

    path: str
    format: Literal["peft", "gguf"]
    modules: list[AdapterModule]
    size_bytes: int
    """The bytes of its A and B tensors as stored."""
    weights_path: str = ""
    """The file the tensors are in (the safetensors file, or the GGUF file itself)."""
    architecture: str | None = None
    """GGUF: the file's general.architecture (decides the q/k un-permutation); PEFT: None."""

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules), default=0)


def read_adapter(path: str) -> AdapterFiles:
    """The adapter at `path` (a PEFT folder or a GGUF LoRA file), or LoRAAdapterError."""
    if not isinstance(path, str) or not path:
        raise LoRAAdapterError("a LoRA adapter needs a path")
    if os.path.isdir(path):
        return _read_peft(path)
    if not os.path.exists(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r} cannot be read: {e.strerror}") from None
    if magic == GGUF_MAGIC:
        return _read_gguf(path)
    raise LoRAAdapterError(
        f"LoRA adapter {path!r} is neither a PEFT folder ({CONFIG_FILE} + {WEIGHTS_FILE}) "
        "nor a GGUF LoRA file")


# -- PEFT ---------------------------------------------------------------------------------

def _read_peft(folder: str) -> AdapterFiles:
    config = _peft_config(folder)
    weights = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(folder, PICKLE_WEIGHTS_FILE)):
            raise LoRAAdapterError(
                f"LoRA adapter {folder!r} has only {PICKLE_WEIGHTS_FILE} (a pickle, which is "
                f"not loaded: it can run code); save it as {WEIGHTS_FILE} "
                "(PEFT's save_pretrained(..., safe_serialization=True))")
        raise LoRAAdapterError(f"LoRA adapter {folder!r} has no {WEIGHTS_FILE}")
    header = _safetensors_header(weights)
    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    size = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        match = _PEFT_TENSOR.match(name)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {folder!r}: tensor {name!r} is not a LoRA A/B matrix (only "
                f"LoRA on {', '.join(TARGETS)} is served; embeddings, lm_head, norms, DoRA "
                "magnitudes and bias terms are not)")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise LoRAAdapterError(
                f"LoRA adapter {folder!r}: tensor {name!r} has dtype {dtype}; "
                f"supported: {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or len(shape) != 2 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise LoRAAdapterError(
                f"LoRA adapter {folder!r}: tensor {name!r} has shape {shape}, not a matrix")
        size += int(offsets[1]) - int(offsets[0])
        pairs.setdefault(match["module"], {})[match["ab"]] = (name, tuple(shape))
    modules = []
    for module_path, pair in pairs.items():
        layer, target = _peft_target(folder, module_path)
        a_name, b_name, rank, in_features, out_features = _pair_shapes(
            folder, module_path, pair.get("A"), pair.get("B"))
        try:
            r, alpha = _module_rank_alpha(config, module_path)
        except LoRAAdapterError as e:
            raise LoRAAdapterError(f"LoRA adapter {folder!r}: {CONFIG_FILE}'s {e}") from None
        if r != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {folder!r}: {CONFIG_FILE} gives {module_path} rank {r} but its "
                f"tensors have rank {rank}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules.append(AdapterModule(layer, target, rank, in_features, out_features, scale,
                                     a_name, b_name))
    if not modules:
        raise LoRAAdapterError(f"LoRA adapter {folder!r} has no LoRA tensors")
    return AdapterFiles(folder, "peft", _sorted(folder, modules), size, weights)


def _peft_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise LoRAAdapterError(f"LoRA adapter {folder!r} has no {CONFIG_FILE}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {folder!r}: {CONFIG_FILE} is not readable JSON "
                               f"({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {folder!r}: {CONFIG_FILE} is not a JSON object")
    where = f"LoRA adapter {folder!r}"
    peft_type = config.get("peft_type")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{where} is a PEFT {peft_type} adapter, not a LoRA one")
    refusals = [
        ("modules_to_save", "modules_to_save (modules trained whole, e.g. lm_head) is not "
                            + "supported: only LoRA on the linear projections is served"),
        ("use_dora", "DoRA (use_dora) is not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style weights) is not supported"),
        ("lora_bias", "lora_bias (a bias on lora_B) is not supported"),
        ("trainable_token_indices", "trained embedding rows (trainable_token_indices) are not "
                                    + "supported"),
        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
        ("target_parameters", "target_parameters (LoRA on raw parameters, e.g. MoE "
                              + "experts') is not supported"),
        ("layer_replication", "layer_replication is not supported"),
    ]
    for key, message in refusals:
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {message}")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={config['bias']!r} (trained biases) is not "
                               "supported; only bias=\"none\"")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        others = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
        if others:
            raise LoRAAdapterError(
                f"{where} targets {', '.join(others)}: only {', '.join(TARGETS)} can be "
                "adapted")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"{where}: {CONFIG_FILE} has no positive {key!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAAdapterError(f"{where}: {key} is not a mapping")
    return config


def _module_rank_alpha(config: dict[str, Any], module_path: str) -> tuple[int, float]:
    """The module's (r, alpha) from the config, by PEFT's get_pattern_key rule: the first
    pattern key k (in the file's order) with re.match(rf"(.*\\.)?({k})$", module path)."""
    def lookup(name: str, default):
        for key, value in (config.get(name) or {}).items():
            try:
                matched = re.match(rf"(.*\.)?({key})$", module_path)
            except re.error:
                raise LoRAAdapterError(f"{name} key {key!r} is not a valid pattern") from None
            if matched:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise LoRAAdapterError(f"{name}[{key!r}] is {value!r}, not a positive number")
                return value
        return default
    return int(lookup("rank_pattern", config["r"])), float(lookup("alpha_pattern",
                                                                   config["lora_alpha"]))


def _peft_target(folder: str, module_path: str) -> tuple[int, str]:
    match = _PEFT_MODULE.match(module_path)
    if match is None:
        raise LoRAAdapterError(
            f"LoRA adapter {folder!r} targets {module_path}: only the decoder layers' "
            f"{', '.join(TARGETS)} can be adapted (not embeddings, lm_head, MoE experts or "
            "vision towers)")
    return int(match["layer"]), match["attn"] or match["mlp"]


def _safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise LoRAAdapterError(f"{path}: truncated safetensors file")
            length = struct.unpack("<Q", head)[0]
            if length > min(size - 8, MAX_SAFETENSORS_HEADER):
                raise LoRAAdapterError(f"{path}: truncated or damaged safetensors file")
            header = json.loads(f.read(length))
    except OSError as e:
        raise LoRAAdapterError(f"{path} cannot be read: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoRAAdapterError(f"{path}: damaged safetensors header") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path}: damaged safetensors header")
    for name, info in header.items():
        if name != "__metadata__" and not (
                isinstance(info, dict) and isinstance(info.get("data_offsets"), list)
                and len(info["data_offsets"]) == 2
                and 0 <= info["data_offsets"][0] <= info["data_offsets"][1]
                <= size - 8 - length):
            raise LoRAAdapterError(f"{path}: damaged safetensors header (tensor {name!r})")
    return header


# -- GGUF ---------------------------------------------------------------------------------

def _read_gguf(path: str) -> AdapterFiles:
    try:
        header = read_gguf_header(path)
    except GGUFHeaderError as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {e}") from None
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r} cannot be read: {e.strerror}") from None
    fields = header.fields
    general_type = fields.get("general.type")
    if general_type != "adapter" or fields.get("adapter.type") != "lora":
        raise LoRAAdapterError(
            f"{path} is a GGUF file but not a LoRA adapter (general.type = {general_type!r}, "
            f"adapter.type = {fields.get('adapter.type')!r}; a LoRA has 'adapter' and 'lora')")
    alpha = fields.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise LoRAAdapterError(f"{path}: adapter.lora.alpha is {alpha!r}, not a number >= 0")
    if fields.get("adapter.alora.invocation_tokens") is not None:
        raise LoRAAdapterError(f"{path}: activated LoRA (invocation tokens) is not supported")
    architecture = fields.get("general.architecture")
    pairs: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    size = 0
    for tensor in header.tensors:
        match = _GGUF_TENSOR.match(tensor.name)
        if match is None or match["part"] not in GGUF_TARGETS:
            raise LoRAAdapterError(
                f"{path}: tensor {tensor.name!r} is not a LoRA A/B matrix of a decoder "
                f"projection (only LoRA on {', '.join(TARGETS)} is served)")
        if len(tensor.shape) != 2:
            raise LoRAAdapterError(
                f"{path}: tensor {tensor.name!r} has shape {tensor.shape}, not a matrix")
        size += tensor.n_bytes
        key = (int(match["layer"]), GGUF_TARGETS[match["part"]])
        pairs.setdefault(key, {})[match["ab"].upper()] = (tensor.name, tensor.shape)
    modules = []
    for (layer, target), pair in pairs.items():
        a_name, b_name, rank, in_features, out_features = _pair_shapes(
            path, f"layer {layer} {target}", pair.get("A"), pair.get("B"))
        scale = float(alpha) / rank if alpha else 1.0  # llama.cpp's get_scale
        modules.append(AdapterModule(layer, target, rank, in_features, out_features, scale,
                                     a_name, b_name))
    if not modules:
        raise LoRAAdapterError(f"{path} has no LoRA tensors")
    return AdapterFiles(path, "gguf", _sorted(path, modules), size, path,
                        str(architecture) if architecture is not None else None)


# -- both ---------------------------------------------------------------------------------

def _pair_shapes(where: str, module: str, a, b) -> tuple[str, str, int, int, int]:
    """(a name, b name, rank, in_features, out_features) of a module's A (r, in) and
    B (out, r), each given as (tensor name, shape) or None when missing."""
    if a is None or b is None:
        missing = "A" if a is None else "B"
        raise LoRAAdapterError(f"LoRA adapter {where!r}: {module} has no lora_{missing} tensor")
    (a_name, (rank, in_features)), (b_name, (out_features, b_rank)) = a, b
    if rank != b_rank or rank <= 0:
        raise LoRAAdapterError(
            f"LoRA adapter {where!r}: {module}'s A {tuple(a[1])} and B {tuple(b[1])} disagree "
            "(A is (rank, in), B is (out, rank))")
    return a_name, b_name, int(rank), int(in_features), int(out_features)


def _sorted(where: str, modules: list[AdapterModule]) -> list[AdapterModule]:
    modules.sort(key=lambda m: (m.layer, TARGETS.index(m.target)))
    for first, second in itertools.pairwise(modules):
        if (first.layer, first.target) == (second.layer, second.target):
            raise LoRAAdapterError(
                f"LoRA adapter {where!r} adapts layer {first.layer} {first.target} twice")
    return modules


__all__ = ["TARGETS", "AdapterFiles", "AdapterModule", "LoRAAdapterError", "read_adapter"]

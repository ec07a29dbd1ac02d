"""Whether a LoRA adapter (adapter_files.AdapterFiles, headers only) fits its base model: every
module's projection sizes, its layer, its rank against --max-lora-rank, and a GGUF adapter's
architecture. No weights are read, no torch."""

from __future__ import annotations

from typing import Any

from pagoda.lora.adapter_files import AdapterFiles, LoRAAdapterError


def _config_value(base_config: Any, key: str, default=None):
    """A field of the base model's HF config (an object, its text config for a multimodal
    one, or a dict)."""
    config = base_config.get_text_config() if hasattr(base_config, "get_text_config") \
        else base_config
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    if value is None:
        if default is None:
            raise LoRAAdapterError(f"the base model's config has no {key!r}")
        return default
    return value


def projection_shapes(base_config: Any) -> dict[str, tuple[int, int]]:
    """target -> (in_features, out_features) of the base model's projections."""
    hidden = int(_config_value(base_config, "hidden_size"))
    heads = int(_config_value(base_config, "num_attention_heads"))
    kv_heads = int(_config_value(base_config, "num_key_value_heads", heads))
    head_dim = int(_config_value(base_config, "head_dim", hidden // heads))
    intermediate = int(_config_value(base_config, "intermediate_size"))
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


GGUF_BASE_TYPES = {"llama": {"llama", "mistral"}}
"""A GGUF adapter's architecture -> the Hugging Face model_types it fits (default: its own
name): a `llama` file's q/k rows are permuted for llama.cpp's rotary, which only a model
converted as `llama` shares."""


def check_adapter(adapter: AdapterFiles, base_config: Any, max_lora_rank: int) -> None:
    """LoRAAdapterError unless every module fits the base model (its HF config, an object or
    a dict): in/out sizes of the projection, layer < num_hidden_layers, and rank <=
    max_lora_rank (--max-lora-rank)."""
    where = f"LoRA adapter {adapter.path!r}"
    if adapter.max_rank > max_lora_rank:
        raise LoRAAdapterError(
            f"{where} has rank {adapter.max_rank}, more than --max-lora-rank {max_lora_rank}")
    shapes = projection_shapes(base_config)
    model_type = _config_value(base_config, "model_type", "")
    if adapter.architecture is not None and model_type and model_type not in \
            GGUF_BASE_TYPES.get(adapter.architecture, {adapter.architecture}):
        raise LoRAAdapterError(
            f"{where} is a GGUF adapter for a {adapter.architecture!r} model, but the base "
            f"model is {model_type!r}")
    layers = int(_config_value(base_config, "num_hidden_layers"))
    for module in adapter.modules:
        if module.layer >= layers:
            raise LoRAAdapterError(
                f"{where} adapts layer {module.layer}, but the base model has {layers} layers")
        expected = shapes[module.target]
        if (module.in_features, module.out_features) != expected:
            raise LoRAAdapterError(
                f"{where}: layer {module.layer} {module.target} is {module.in_features} -> "
                f"{module.out_features}, but the base model's is {expected[0]} -> "
                f"{expected[1]} (an adapter for another model?)")

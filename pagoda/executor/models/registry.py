"""Model classes by the `architectures` name of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from pagoda.executor.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    latent_attention_shape,
)
from pagoda.executor.models.ernie import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM
from pagoda.executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagoda.executor.models.gpt_oss import GptOssForCausalLM
from pagoda.executor.models.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from pagoda.executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    head_dim_of,
)
from pagoda.executor.models.llama4 import Llama4ForCausalLM
from pagoda.executor.models.mixtral import (
    Glm4MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from pagoda.executor.models.phimoe import PhimoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "PhiMoEForCausalLM": PhimoeForCausalLM,  # (the published checkpoint's, remote code)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    # Bare decoder stacks (embedding models saved without the head: safetensors_loader.py)
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {', '.join(architectures) or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def has_latent_attention(hf_config) -> bool:
    """DeepSeek's multi-head latent attention: its cache holds one latent head, keys only."""
    return bool(getattr(hf_config, "kv_lora_rank", None))


def attention_shape(hf_config) -> tuple[int, int, int]:
    """(query heads, cached heads, cached head size) of the config's attention layers:
    DeepSeek's latent attention caches one head of its latent; the others their KV heads."""
    if has_latent_attention(hf_config):
        return latent_attention_shape(hf_config)
    return (hf_config.num_attention_heads, hf_config.num_key_value_heads,
            head_dim_of(hf_config))

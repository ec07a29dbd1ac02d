"""Model classes by the `architectures` name of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from pagoda.executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    pass


def resolve_model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {', '.join(architectures) or '(none given)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )

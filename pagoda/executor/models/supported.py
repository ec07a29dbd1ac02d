"""The architectures Pagoda runs, by name only: importable without torch, so that
`pagoda --help` can list them. registry.py (Hugging Face `architectures`) and
loader/gguf_architectures.py (GGUF `general.architecture`) hold the implementations; a test
keeps the three in step."""

from __future__ import annotations

import textwrap

HF_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
    "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
    "Glm4MoeForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "GptOssForCausalLM",
    "PhimoeForCausalLM", "PhiMoEForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
    # (text and vision in one checkpoint: its language model; safetensors_loader.py)
    # bare decoder stacks, as embedding models are saved (no head: embeddings only)
    "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model",
)
"""config.json `architectures` of a Hugging Face folder."""
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "olmoe", "granite", "granitemoe",
                      "glm4moe", "ernie4_5", "ernie4_5-moe", "gpt-oss", "phi3", "phimoe",
                      "gemma2", "gemma3", "deepseek2", "llama4")
"""GGUF `general.architecture` (a `llama` file with experts is Mixtral)."""


def describe_supported(width: int = 79) -> str:
    """Both lists, wrapped for help texts."""
    hf = f"Hugging Face architectures: {', '.join(HF_ARCHITECTURES)}."
    gguf = f"GGUF architectures: {', '.join(GGUF_ARCHITECTURES)} (llama with experts: Mixtral)."
    return "\n".join(textwrap.fill(text, width, subsequent_indent="  ") for text in (hf, gguf))

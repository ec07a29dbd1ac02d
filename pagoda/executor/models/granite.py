"""IBM Granite (dense) and Granite MoE: Llama blocks with four scalars from the config.

    embedding_multiplier   the token embeddings are multiplied by it
    attention_multiplier   the attention scale (in place of head_dim ** -0.5)
    residual_multiplier    each attention and MLP output is multiplied by it before it is
                           added to the residual stream
    logits_scaling         the logits are divided by it

Granite MoE's layers are sparse MoE blocks (layers/moe.py) routed by the top-k logits with a
softmax over those k (`softmax_after_top_k`). Its checkpoint stores each layer's experts
stacked: block_sparse_moe.input_linear.weight (experts, 2 * intermediate, hidden), rows
[gate | up], and output_linear.weight (experts, hidden, intermediate); the router is
block_sparse_moe.router.layer.weight. `split_stacked_experts` turns them into the per-expert
names the block's modules have.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.executor.layers.moe import SparseMoeBlock
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class GraniteAttention(LlamaAttention):
    """Llama attention scaled by attention_multiplier, its output by residual_multiplier."""

    def __init__(self, config, rotary, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__(config, rotary, qkv_bias, qk_norm,
                         scale=float(config.attention_multiplier))
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, hidden) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    """A Llama MLP whose output is multiplied by residual_multiplier."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteMoeBlock(SparseMoeBlock):
    """Granite MoE's sparse block (its experts plain Llama MLPs), output multiplied by
    residual_multiplier."""

    def __init__(self, config) -> None:
        super().__init__(config.hidden_size,
                         [LlamaMLP(config) for _ in range(config.num_local_experts)],
                         config.num_experts_per_tok, normalize_top_k=False,
                         weights_in_run_dtype=True, softmax_after_top_k=True)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) * self.residual_multiplier


class GraniteModel(LlamaModel):
    """Llama's stack with Granite's attention and MLPs, over embeddings times
    embedding_multiplier."""

    def __init__(self, config, max_position: int, make_mlp, mlp_name: str = "mlp") -> None:
        super().__init__(config, bool(getattr(config, "attention_bias", False)), False,
                         max_position, make_mlp, mlp_name, attention_class=GraniteAttention)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Dense Granite: GraniteModel, logits divided by logits_scaling."""

    def build_model(self, config, max_position: int) -> nn.Module:
        return GraniteModel(config, max_position, lambda index: GraniteMLP(config))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().head_logits(hidden) / float(self.config.logits_scaling)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite MoE: every layer a GraniteMoeBlock, its experts stored stacked."""

    def build_model(self, config, max_position: int) -> nn.Module:
        return GraniteModel(config, max_position, lambda index: GraniteMoeBlock(config),
                            mlp_name="block_sparse_moe")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(weights))


def split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite MoE's stacked expert tensors and router as the block's module names:
    input_linear (E, 2I, H) -> experts.{e}.gate_up_proj (stored fused, [gate | up]),
    output_linear (E, H, I) -> experts.{e}.down_proj, router.layer -> gate. (A GGUF file's
    names are already per expert: they pass through.)"""
    for name, tensor in weights:
        if name.endswith("block_sparse_moe.router.layer.weight"):
            yield name.replace("router.layer", "gate"), tensor
        elif name.endswith(("block_sparse_moe.input_linear.weight",
                            "block_sparse_moe.output_linear.weight")):
            part = "gate_up_proj" if "input_linear" in name else "down_proj"
            prefix = name.rsplit(".", 2)[0]  # model.layers.{l}.block_sparse_moe
            for expert, weight in enumerate(tensor.unbind(0)):
                yield f"{prefix}.experts.{expert}.{part}.weight", weight
        else:
            yield name, tensor

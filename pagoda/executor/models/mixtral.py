"""Mixture-of-experts families on Llama blocks: Mixtral, Qwen3-MoE, OLMoE and GLM-4.5.

Attention is Llama's (Mixtral: Mistral's, sliding window included; Qwen3-MoE: Qwen3's, with
q/k norms); the MLP of each layer is a `SparseMoeBlock` (layers/moe.py) whose experts are
SwiGLU MLPs, named as in the checkpoints:

    Mixtral     model.layers.{l}.block_sparse_moe.gate               the router
                model.layers.{l}.block_sparse_moe.experts.{i}.w1/w3  gate / up -> fused w13
                model.layers.{l}.block_sparse_moe.experts.{i}.w2     down
    Qwen3-MoE   model.layers.{l}.mlp.gate
                model.layers.{l}.mlp.experts.{i}.gate_proj/up_proj   -> fused gate_up_proj
                model.layers.{l}.mlp.experts.{i}.down_proj
                (layers in mlp_only_layers, or off decoder_sparse_step, are dense MLPs)
    OLMoE       as Qwen3-MoE, every layer sparse; its q/k norms span all heads at once
                (q_norm over num_heads * head_dim, before the heads are split) and
                clip_qkv, where set, clamps q, k and v
    GLM-4.5     (Glm4Moe) model.layers.{l}.mlp.gate (+ e_score_correction_bias): grouped
                sigmoid routing (layers/moe.py: CorrectionBiasRouter); mlp.experts.{i} and
                mlp.shared_experts (one MLP of n_shared_experts * moe_intermediate_size);
                the first first_k_dense_replace layers dense; qkv bias, optional per-head
                q/k norms, partial rotary; the next-token-prediction (MTP) layers stored
                after num_hidden_layers are not run and not loaded
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.layers.activation import gated_activation
from pagoda.executor.layers.linear import Linear, MergedLinear
from pagoda.executor.layers.moe import CorrectionBiasRouter, SparseMoeBlock
from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.models.llama import (
    STACKED_PARAMS,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class MixtralExpert(nn.Module):
    """w2(silu(w1 x) * w3 x), w1 and w3 fused: w13 rows [w1 | w3]."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.w13 = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size})
        self.w2 = Linear(intermediate_size, hidden_size)
        self.act = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w13(x)))


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral attention; every layer a sparse MoE (softmax, top-k, renormalised)."""

    stacked_params = STACKED_PARAMS + [(".w13.", ".w1.", 0), (".w13.", ".w3.", 1)]

    def build_model(self, config, max_position: int) -> nn.Module:
        activation = getattr(config, "hidden_act", "silu")

        def make_mlp(index: int) -> nn.Module:
            experts = [MixtralExpert(config.hidden_size, config.intermediate_size, activation)
                       for _ in range(config.num_local_experts)]
            return SparseMoeBlock(config.hidden_size, experts, config.num_experts_per_tok,
                                  normalize_top_k=True)

        qkv_bias = bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, qkv_bias, False, max_position, make_mlp,
                          mlp_name="block_sparse_moe")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 attention (q/k norms); sparse MoE layers (top-k renormalised only with
    norm_topk_prob), dense MLPs in `mlp_only_layers` and off `decoder_sparse_step`."""

    qk_norm = True

    def build_model(self, config, max_position: int) -> nn.Module:
        num_experts = config.num_experts
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_layers = set(getattr(config, "mlp_only_layers", None) or [])

        def make_mlp(index: int) -> nn.Module:
            if index in dense_layers or num_experts == 0 or (index + 1) % sparse_step:
                return LlamaMLP(config)
            experts = [LlamaMLP(config, intermediate_size=config.moe_intermediate_size)
                       for _ in range(num_experts)]
            return SparseMoeBlock(
                config.hidden_size, experts, config.num_experts_per_tok,
                normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
                weights_in_run_dtype=True,
            )

        qkv_bias = bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, qkv_bias, True, max_position, make_mlp)

    @property
    def sliding_window(self) -> int | None:
        if getattr(self.config, "use_sliding_window", False):
            return self.config.sliding_window
        return None


class OlmoeAttention(LlamaAttention):
    """Llama attention whose q and k norms are each one RMSNorm over all heads' features
    (q: num_heads * head_dim, k: num_kv_heads * head_dim), applied before the heads are
    split and rotated; then q, k and v are clamped to +-clip_qkv where the config sets it."""

    def __init__(self, config, rotary, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__(config, rotary, qkv_bias, qk_norm=False)
        self.q_size, self.kv_size = (self.num_heads * self.head_dim,
                                     self.num_kv_heads * self.head_dim)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        qk = torch.cat((q, k), dim=-1).view(num_tokens, self.num_heads + self.num_kv_heads,
                                            self.head_dim)
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v.reshape(num_tokens, self.num_kv_heads,
                                                     self.head_dim)))


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE: OlmoeAttention; every layer a sparse MoE of SwiGLU experts (softmax, top-k,
    renormalised only with norm_topk_prob, weights cast to the run dtype)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        def make_mlp(index: int) -> nn.Module:
            experts = [LlamaMLP(config) for _ in range(config.num_experts)]
            return SparseMoeBlock(
                config.hidden_size, experts, config.num_experts_per_tok,
                normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
                weights_in_run_dtype=True,
            )

        qkv_bias = bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, qkv_bias, False, max_position, make_mlp,
                          attention_class=OlmoeAttention)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 / GLM-4.5-Air (see the module docstring)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        def make_mlp(index: int) -> nn.Module:
            if index < config.first_k_dense_replace:
                return LlamaMLP(config)
            return routed_and_shared_experts(config, CorrectionBiasRouter(
                config.hidden_size, config.n_routed_experts, "sigmoid",
                bool(config.norm_topk_prob), float(config.routed_scaling_factor),
                config.n_group, config.topk_group))

        return LlamaModel(config, bool(config.attention_bias), bool(config.use_qk_norm),
                          max_position, make_mlp)

    def load_weights(self, weights) -> None:
        super().load_weights(without_layers_past(weights, self.config.num_hidden_layers))


def routed_and_shared_experts(config, router: nn.Module) -> SparseMoeBlock:
    """GLM-4.5's and DeepSeek's MoE MLP: n_routed_experts SwiGLU experts of
    moe_intermediate_size chosen by `router`'s rule, plus a shared expert of n_shared_experts
    times that size (none where 0)."""
    size = config.moe_intermediate_size
    shared = (LlamaMLP(config, intermediate_size=size * config.n_shared_experts)
              if config.n_shared_experts else None)
    return SparseMoeBlock(
        config.hidden_size,
        [LlamaMLP(config, intermediate_size=size) for _ in range(config.n_routed_experts)],
        config.num_experts_per_tok, normalize_top_k=False, router=router,
        shared_experts=shared)


def without_layers_past(weights, num_layers: int):
    """`weights` but those of model.layers.{i} with i >= num_layers (next-token-prediction
    layers stored after the model's own: GLM-4.5's, DeepSeek-V3's)."""
    for name, tensor in weights:
        parts = name.split(".")
        if not (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= num_layers):
            yield name, tensor

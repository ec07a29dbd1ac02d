"""Microsoft's Phi-3.5-MoE (PhimoeForCausalLM): Mixtral's layout (block_sparse_moe, experts
w1/w3/w2, a sliding window from the config) with

- LayerNorm with a bias for every norm, where Mixtral has RMSNorm;
- a bias on q/k/v and o where `attention_bias`, and on the logits head where `lm_head_bias`
  (LlamaForCausalLM's head takes one);
- sparsemixer top-2 routing (layers/moe.py: SparseMixerRouter, `router_jitter_noise`);
- LongRoPE whose cos and sin are scaled by `short_mscale` / `long_mscale` (one value: the
  released model's two are equal; unequal ones are refused).
"""

from __future__ import annotations

from torch import nn

from pagoda.executor.layers.moe import SparseMixerRouter, SparseMoeBlock
from pagoda.executor.layers.norm import LayerNorm
from pagoda.executor.models.llama import LlamaAttention, LlamaModel
from pagoda.executor.models.mixtral import MixtralExpert, MixtralForCausalLM


class PhimoeAttention(LlamaAttention):
    """LlamaAttention with o_proj's bias as q/k/v's."""

    def __init__(self, config, rotary, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__(config, rotary, qkv_bias, qk_norm, o_bias=qkv_bias)


class PhimoeForCausalLM(MixtralForCausalLM):
    """PhiMoE (see the module docstring)."""

    def __init__(self, config, max_position: int) -> None:
        take_mscale(config)
        super().__init__(config, max_position)

    def build_model(self, config, max_position: int) -> nn.Module:
        activation = getattr(config, "hidden_act", "silu")

        def make_mlp(index: int) -> nn.Module:
            experts = [MixtralExpert(config.hidden_size, config.intermediate_size, activation)
                       for _ in range(config.num_local_experts)]
            router = SparseMixerRouter(config.hidden_size, config.num_local_experts,
                                       float(config.router_jitter_noise))
            return SparseMoeBlock(config.hidden_size, experts, config.num_experts_per_tok,
                                  normalize_top_k=False, router=router)

        return LlamaModel(config, bool(config.attention_bias), False, max_position, make_mlp,
                          mlp_name="block_sparse_moe", attention_class=PhimoeAttention,
                          norm_class=LayerNorm)


def take_mscale(config) -> None:
    """LongRoPE's short_mscale / long_mscale as the attention factor the rotary scales cos
    and sin by (ValueError where the two differ)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope" or "short_mscale" not in params:
        return
    short, long = float(params["short_mscale"]), float(params.get("long_mscale", 1.0))
    if short != long:
        raise ValueError(f"PhiMoE LongRoPE with short_mscale {short} != long_mscale {long} "
                         "is not supported (the released model's are equal)")
    params["attention_factor"] = short

"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 (Kimi K2's architecture too): multi-head latent
attention (MLA) on Llama blocks, and sparse MoE layers with shared experts.

MLA compresses each token's keys and values into one latent of `kv_lora_rank` features plus
a `qk_rope_head_dim` rotary key shared by every head:

    latent, k_pe = split(kv_a_proj_with_mqa(x), [rank, rope]);  latent = kv_a_layernorm(latent)
    per head h:  k_h = [W_UK_h latent | k_pe]    v_h = W_UV_h latent
                 (kv_b_proj.weight viewed (heads, nope + v, rank): W_UK_h its first nope rows,
                  W_UV_h the next v)

Here it runs in the absorbed form: q_nope_h . (W_UK_h latent) = (W_UK_h^T q_nope_h) . latent,
so each head's query is taken into latent space, attention is multi-query over one cached
head of [latent | k_pe] (rank + rope features: 576 for V2/V3, against heads x (192 + 128)
when the keys and values are expanded), and the output, still a latent, leaves through W_UV_h.
The cache holds that one head once (Attention's `values_in_keys`): it is the key and, read
again, the value (whose last `rope` features are dropped after attention). kv_b_proj is therefore kept as a float matrix
(`LatentUpProjection`, not a Linear: never quantized nor packed).

The rotary part is DeepSeek's: pairs (x0, x1), (x2, x3), ... turn together (`rope_interleave`,
V2 always); they are de-interleaved before Llama's rotate-half rotary, which is the same
rotation of the same pairs. YaRN's `mscale_all_dim` also scales the softmax (by mscale^2).

Routing: V3 as GLM-4.5 (sigmoid, correction bias, expert groups: CorrectionBiasRouter); V2
softmax, greedy or group-limited (GroupLimitedRouter). The first `first_k_dense_replace`
layers are dense; next-token-prediction layers stored past num_hidden_layers are not loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.attention.layer import Attention
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.moe import CorrectionBiasRouter, GroupLimitedRouter
from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.layers.rope_scaling import yarn_get_mscale
from pagoda.executor.layers.rotary import RotaryEmbedding, rope_parameters
from pagoda.executor.models.llama import STACKED_PARAMS, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagoda.executor.models.mixtral import routed_and_shared_experts, without_layers_past

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's epsilon: the reference code's default, not the
config's rms_norm_eps."""


def latent_attention_shape(config) -> tuple[int, int, int]:
    """(query heads, cached heads, cached head size) of an MLA model's attention layers."""
    return config.num_attention_heads, 1, config.kv_lora_rank + config.qk_rope_head_dim


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN scaling."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_get_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    return scale


class LatentUpProjection(nn.Module):
    """kv_b_proj: weight (heads * (nope + v), rank), used absorbed (the module docstring).

    Loaded whole (a Hugging Face checkpoint, an older GGUF file's attn_kv_b) or as the two
    parts llama.cpp's converter splits it into: "k" its k_b_proj (heads, rank, nope), each
    head's W_UK transposed, and "v" its v_b_proj (heads, v, rank)."""

    shard_offsets = ("k", "v")
    """The parts load_weights requires (LlamaForCausalLM.load_weights)."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, rank: int) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim, self.rank = num_heads, nope_dim, v_dim, rank
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), rank),
                                   requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: str | None) -> None:
        heads = param.data.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        if shard_id is None:
            target, source = param.data, tensor
        elif shard_id == "k":
            target, source = heads[:, :self.nope_dim], tensor.transpose(1, 2)
        else:
            target, source = heads[:, self.nope_dim:], tensor
        if source.shape != target.shape:
            part = "kv_b_proj" if shard_id is None else f"{shard_id}_b_proj"
            raise ValueError(f"{part} of shape {tuple(tensor.shape)} does not fit "
                             f"{self.num_heads} heads of {self.nope_dim} + {self.v_dim} rows "
                             f"over a {self.rank}-feature latent")
        target.copy_(source)

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)

    def absorb_queries(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (T, heads, nope) -> (T, heads, rank): each head's W_UK^T q."""
        return torch.einsum("thn,hnr->thr", q_nope, self._per_head()[:, :self.nope_dim])

    def expand_values(self, latents: torch.Tensor) -> torch.Tensor:
        """latents (T, heads, rank) -> (T, heads, v): each head's W_UV latent."""
        return torch.einsum("thr,hvr->thv", latents, self._per_head()[:, self.nope_dim:])


class LatentAttention(nn.Module):
    """MLA (the module docstring); q straight from q_proj where q_lora_rank is None
    (V2-Lite), else q_b_proj(q_a_layernorm(q_a_proj(x)))."""

    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=qkv_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, q_size)
        else:
            self.q_proj = Linear(hidden, q_size)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.num_heads, self.nope_dim, self.v_dim, self.rank)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=qkv_bias)
        self.rotary = rotary
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        _, cached_heads, cached_dim = latent_attention_shape(config)
        self.attn = Attention(self.num_heads, cached_heads, cached_dim, softmax_scale(config),
                              values_in_keys=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank
             else self.q_proj(hidden))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        pe = torch.cat((q_pe, k_pe.unsqueeze(1)), dim=1)  # (T, heads + 1, rope)
        if self.interleaved:  # pairs (0, 1), (2, 3), ... -> halves [0 2 4 ... | 1 3 5 ...]
            pe = pe.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        q_pe, k_pe = self.rotary(positions, pe.contiguous()).split([self.num_heads, 1], dim=1)
        query = torch.cat((self.kv_b_proj.absorb_queries(q_nope), q_pe), dim=-1)
        key = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)  # (T, 1, rank + rope)
        out = self.attn(query, key, key).view(num_tokens, self.num_heads, -1)[..., :self.rank]
        values = self.kv_b_proj.expand_values(out)  # (T, heads, v)
        return self.o_proj(values.reshape(num_tokens, self.num_heads * self.v_dim))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V2-Lite (the module docstring)."""

    stacked_params = (*(entry for entry in STACKED_PARAMS if entry[0] == ".gate_up_proj."),
                      (".kv_b_proj.", ".k_b_proj.", "k"), (".kv_b_proj.", ".v_b_proj.", "v"))
    """No fused q/k/v (q_proj, kv_a_proj_with_mqa, kv_b_proj are separate); kv_b_proj's parts
    as a llama.cpp file splits it (LatentUpProjection)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        config.head_dim = config.qk_rope_head_dim  # what the shared rotary turns

        def make_mlp(index: int) -> nn.Module:
            if index < config.first_k_dense_replace:
                return LlamaMLP(config)
            return routed_and_shared_experts(config, self.router(config))

        return LlamaModel(config, bool(getattr(config, "attention_bias", False)), False,
                          max_position, make_mlp, attention_class=LatentAttention)

    def router(self, config) -> nn.Module:
        method = getattr(config, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r}: greedy or "
                             f"group_limited_greedy")
        grouped = method == "group_limited_greedy"
        return GroupLimitedRouter(config.hidden_size, config.n_routed_experts,
                                  float(config.routed_scaling_factor),
                                  config.n_group if grouped else 1,
                                  config.topk_group if grouped else 1)

    def load_weights(self, weights) -> None:
        super().load_weights(without_layers_past(weights, self.config.num_hidden_layers))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1, Kimi K2: V2's attention; noaux_tc routing (sigmoid scores, a
    correction bias in the choice, expert groups), renormalised where norm_topk_prob."""

    def router(self, config) -> nn.Module:
        return CorrectionBiasRouter(
            config.hidden_size, config.n_routed_experts, "sigmoid",
            bool(config.norm_topk_prob), float(config.routed_scaling_factor),
            config.n_group, config.topk_group)

"""Meta's Llama 4, text (Llama4ForCausalLM: Scout's and Maverick's language model).

Llama blocks with two kinds of attention layer, by `config.no_rope_layers` (1: rotary):

- rotary layers: chunked local attention (a query at p sees keys p // chunk * chunk .. p,
  `attention_chunk_size`, where `layer_types` says "chunked_attention"), q and k normed
  after the rotary by a weightless RMS norm over each head (`use_qk_norm`);
- NoPE layers: no rotary, attention over the whole context, and, with
  `attn_temperature_tuning`, queries scaled by log1p(floor((p + 1) / floor_scale)) *
  attn_scale + 1 (longer contexts, sharper attention).

Meta's rotary turns adjacent pairs (x0, x1), (x2, x3), ...: q_proj and k_proj rows are put in
halves order at load (`half_rotary`), so Llama's rotate-half rotary turns the same pairs
(dot products between q and k are unchanged by the reordering, and so are the per-head
norms). A GGUF file's rows are reordered by the GGUF loader instead (packed rows included,
which never reach load_weights): its config says `rotary_rows_in_halves`.

The MLP is `feed_forward`: on `moe_layers` a sparse MoE (the router's top-k logits, each
chosen expert's input scaled by its logit's sigmoid: SparseMoeBlock's weights_scale_inputs),
plus a shared expert; elsewhere a dense MLP of intermediate_size_mlp. The checkpoint stacks
each layer's experts input-major:

    feed_forward.experts.gate_up_proj  (E, hidden, 2 * I)   columns [gate | up]
    feed_forward.experts.down_proj     (E, I, hidden)
    feed_forward.router.weight         (E, hidden)           -> feed_forward.gate
    feed_forward.shared_expert.*                             -> feed_forward.shared_experts
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.layers.moe import SigmoidTopKRouter, SparseMoeBlock
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    half_rotary,
)

CHUNKED = "chunked_attention"


class Llama4Attention(LlamaAttention):
    """LlamaAttention of layer `index` (the module docstring)."""

    def __init__(self, config, rotary, index: int) -> None:
        chunked = list(config.layer_types)[index] == CHUNKED
        super().__init__(config, rotary, bool(config.attention_bias), False,
                         chunk=config.attention_chunk_size if chunked else None)
        self.uses_rotary = bool(config.no_rope_layers[index])
        self.norms_qk = self.uses_rotary and bool(config.use_qk_norm)
        self.qk_norm_eps = config.rms_norm_eps
        self.tunes_temperature = not self.uses_rotary and bool(config.attn_temperature_tuning)
        self.floor_scale, self.attn_scale = float(config.floor_scale), float(config.attn_scale)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split(self.qk_v_sizes, dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.uses_rotary:
            qk = self.rotary(positions, qk)
        if self.norms_qk:  # a weightless RMS norm of each head, in float32
            qk = F.rms_norm(qk.float(), (self.head_dim,), None, self.qk_norm_eps).to(qk.dtype)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.tunes_temperature:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            q = (q * (scales * self.attn_scale + 1.0).view(-1, 1, 1)).to(q.dtype)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 text (the module docstring)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        moe_layers = set(config.moe_layers)

        def make_mlp(index: int) -> nn.Module:
            if index not in moe_layers:
                return LlamaMLP(config, intermediate_size=config.intermediate_size_mlp)
            return SparseMoeBlock(
                config.hidden_size,
                [LlamaMLP(config) for _ in range(config.num_local_experts)],
                config.num_experts_per_tok, normalize_top_k=False,
                router=SigmoidTopKRouter(config.hidden_size, config.num_local_experts),
                shared_experts=LlamaMLP(config), weights_scale_inputs=True)

        return LlamaModel(config, bool(config.attention_bias), False, max_position, make_mlp,
                          mlp_name="feed_forward",
                          make_attention=lambda index, rotary: Llama4Attention(
                              config, rotary, index))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = self._renamed(weights)
        if not getattr(self.config, "rotary_rows_in_halves", False):
            weights = half_rotary(weights, self.config)
        super().load_weights(weights)

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names and stacked experts as the modules take them (the module
        docstring)."""
        for name, tensor in weights:
            prefix, _, last = name.rpartition(".")
            if prefix.endswith(".feed_forward.router"):
                yield f"{prefix.removesuffix('.router')}.gate.{last}", tensor
            elif ".feed_forward.shared_expert." in name:
                yield name.replace(".shared_expert.", ".shared_experts."), tensor
            elif prefix.endswith(".feed_forward.experts") and last in ("gate_up_proj",
                                                                      "down_proj"):
                for expert, part in enumerate(tensor):  # (hidden, 2I) / (I, hidden)
                    yield f"{prefix}.{expert}.{last}.weight", part.t().contiguous()
            else:
                yield name, tensor

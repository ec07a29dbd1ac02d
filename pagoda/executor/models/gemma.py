"""Gemma 2 and Gemma 3 (text): Llama-shaped attention and GeGLU MLP, with

- RMSNorm scaling by (1 + weight): the loader adds the 1 once (`GemmaRMSNorm`);
- four norms a layer: the attention and MLP outputs are normed before the residual add;
- the embedding scaled by sqrt(hidden_size), in the run dtype as Hugging Face rounds it;
- interleaved sliding-window ("sliding_attention") and global ("full_attention") layers,
  from `config.layer_types`; each attention layer carries its own window;
- attention scale query_pre_attn_scalar ** -0.5;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: RMSNorm over each q and k head, and a rope base per layer type
  (`rope_local_base_freq` for the sliding layers).

One layer with the fused residual norms (x + residual, normed, in one call):

    residual, h = h + residual, input_layernorm(h + residual)
    h = post_attention_layernorm(attention(h))
    residual, h = h + residual, pre_feedforward_layernorm(h + residual)
    h = post_feedforward_layernorm(mlp(h))         -> the next layer adds it to residual
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.layers.rotary import RotaryEmbedding
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    head_dim_of,
    unfilled_embedding,
)

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) with Hugging Face's w: the weight holds 1 + w, in float32 whatever
    the run dtype (w is small, so a bf16 1 + w would lose most of its bits), and half-precision
    inputs are normed and scaled in float32, then cast, as Hugging Face does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.weight_loader = load_one_plus

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        return normed if residual is None else (normed, residual)


def load_one_plus(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded.float() + 1.0)


def layer_types(config) -> list[str]:
    """Each layer's attention kind; configs without `layer_types` follow the family's
    pattern (Gemma 2: every other layer slides, from the first; Gemma 3: all but every
    sliding_window_pattern-th)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or 2
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config, rotary: RotaryEmbedding, layer_type: str, qk_norm: bool,
        attn_softcap: float | None,
    ) -> None:
        super().__init__()
        window = config.sliding_window if layer_type == SLIDING else None
        self.self_attn = LlamaAttention(
            config, rotary, bool(getattr(config, "attention_bias", False)), qk_norm,
            scale=config.query_pre_attn_scalar**-0.5, sliding_window=window,
            logit_softcap=attn_softcap, o_bias=bool(getattr(config, "attention_bias", False)),
            norm_class=GemmaRMSNorm,
        )
        self.mlp = LlamaMLP(config, activation=config.hidden_activation)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(
        self, config, max_position: int, qk_norm: bool, attn_softcap: float | None
    ) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma (an embedding model) is not supported: "
                             "Pagoda runs causal language models")
        self.embed_tokens = unfilled_embedding(config)
        self.embed_scale = config.hidden_size**0.5
        types = layer_types(config)
        head_dim = head_dim_of(config)
        # One rotary table per layer type (Gemma 3 gives each its own base and scaling).
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(config, head_dim, max_position, layer_type=kind)
            for kind in sorted(set(types))
        })
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, self.rotaries[kind], kind, qk_norm, attn_softcap)
            for kind in types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # Hugging Face multiplies by the scale rounded to the embedding's dtype.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention scores and logits; no q/k norms."""

    qk_norm = False
    attention_softcap = True

    def build_model(self, config, max_position: int) -> nn.Module:
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        attn_softcap = (getattr(config, "attn_logit_softcapping", None)
                        if self.attention_softcap else None)
        return GemmaModel(config, max_position, self.qk_norm, attn_softcap)

    @property
    def sliding_window(self) -> int | None:
        return None  # each sliding layer's attention carries the window


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norms, a rope base per layer type; Hugging Face applies no
    attention soft-capping (whatever the config says) but caps the logits if asked."""

    qk_norm = True
    attention_softcap = False

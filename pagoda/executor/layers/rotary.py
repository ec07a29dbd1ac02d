"""Rotary position embedding, cos/sin precomputed once for every position.

Hugging Face layout ("rotate_half"): a head vector's two halves form the (x, y) pairs.
Supported scalings: default, linear, llama3 (Llama 3.1), longrope (Phi-3.5, Phi-4-mini), yarn
and dynamic NTK (rope_scaling.py; dynamic in vLLM's static form), and per-frequency factors as
stored in GGUF files (`rope_freqs.weight`, llama.cpp's form of llama3 scaling). Partial
rotary (`partial_rotary_factor` < 1) rotates the first dims of each head only.
Models with per-layer rope settings (Gemma 3: `rope_parameters` keyed by layer type) build
one RotaryEmbedding per layer type.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagoda.executor.layers.rope_scaling import dynamic_ntk_inv_freq, yarn_inv_freq


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope settings of a HF config, old style (rope_theta + rope_scaling) or new;
    `layer_type` picks one entry of per-layer-type settings (Gemma 3's "sliding_attention" /
    "full_attention")."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    elif params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return params


def compute_inv_freq(hf_config, params: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """((rotary_dim // 2,) float32 inverse frequencies after scaling, the factor cos and sin
    are multiplied by: 1 but for yarn) (longrope: see `longrope_tables`)."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(hf_config, params, rotary_dim)
    if rope_type == "dynamic":
        return dynamic_ntk_inv_freq(hf_config, params, rotary_dim), 1.0
    raise ValueError(
        f"rope type {rope_type!r} is not supported (default, linear, llama3, longrope, yarn, "
        "dynamic are)"
    )


def longrope_tables(
    hf_config, params: dict, rotary_dim: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """LongRoPE (Phi-3.5, Phi-4-mini): (short inv_freq, long inv_freq, attention factor,
    original context length: the first position that takes the long frequencies).

    Hugging Face divides the frequencies by `short_factor` while a sequence is within
    `original_max_position_embeddings` and recomputes every position with `long_factor` once
    it is longer. A paged cache cannot re-rotate the keys it holds, so here positions below
    the original length take the short factors and those past it the long ones (vLLM's
    choice): the same numbers as Hugging Face whenever max_model_len stays within the
    original length. cos and sin are scaled by the attention factor either way."""
    original = int(params.get("original_max_position_embeddings")
                   or hf_config.original_max_position_embeddings)
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    base = float(params["rope_theta"])
    powers = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * powers)
    if max_position <= original:
        long = short
    return short, long, float(attention_factor), original


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        params = rope_parameters(hf_config, layer_type)
        # Partial rotary: the first rotary_dim dims of each head turn, the rest pass through.
        self.rotary_dim = int(head_dim * float(params["partial_rotary_factor"]))
        self.attention_factor = 1.0
        self.long_inv_freq, self.long_from = None, max_position
        if params["rope_type"] == "longrope":
            self.inv_freq, self.long_inv_freq, self.attention_factor, self.long_from = (
                longrope_tables(hf_config, params, self.rotary_dim, max_position))
        else:
            self.inv_freq, self.attention_factor = compute_inv_freq(
                hf_config, params, self.rotary_dim)
        self._last_lookup: tuple | None = None
        self._build_cache()

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF's rope_freqs: each inverse frequency is divided by its factor."""
        self.inv_freq = self.inv_freq / factors.float().to(self.inv_freq.device)
        self._build_cache()

    def _build_cache(self) -> None:
        positions = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, self.inv_freq)  # (max_position, rotary_dim // 2)
        if self.long_inv_freq is not None and self.long_from < self.max_position:
            freqs[self.long_from:] = torch.outer(positions[self.long_from:], self.long_inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        signed = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        device = getattr(self, "cos_cache", torch.empty(0)).device
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin
        self.register_buffer("signed_sin_cache", (sin * signed).to(device), persistent=False)
        self._last_lookup = None

    def forward(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """positions (T,); heads (T, num_heads, D): every head of a token is rotated by its
        position (callers pass q's and k's heads together, one pass for both).

        Hugging Face computes x * cos + rotate_half(x) * sin with rotate_half(x) =
        cat(-x2, x1); the same products come from roll(x, D/2) = cat(x2, x1) times sin
        with its first half negated: two fewer ops, same roundings."""
        cos, signed_sin = self._cos_sin(positions, heads.dtype)
        if self.rotary_dim < self.head_dim:
            turned, passed = heads.split([self.rotary_dim, self.head_dim - self.rotary_dim], -1)
            turned = turned * cos + turned.roll(self.rotary_dim // 2, dims=-1) * signed_sin
            return torch.cat((turned, passed), dim=-1)
        return heads * cos + heads.roll(self.head_dim // 2, dims=-1) * signed_sin

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, rotary_dim) cos and signed sin of `positions`. Every layer of a step gets
        the same positions tensor, so they are looked up once per step: the last lookup is
        kept with a reference to its positions tensor (identity, not value, decides a hit)."""
        compiling = torch.compiler.is_compiling()  # the compiled graph computes it once anyway
        last = self._last_lookup
        if not compiling and last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        signed_sin = self.signed_sin_cache[positions].unsqueeze(1).to(dtype)
        if not compiling:
            self._last_lookup = (positions, dtype, cos, signed_sin)
        return cos, signed_sin

"""Rotary position embedding, cos/sin precomputed once for every position.

Hugging Face layout ("rotate_half"): a head vector's two halves form the (x, y) pairs.
Supported scalings: default, linear, llama3 (Llama 3.1), and per-frequency factors as stored
in GGUF files (`rope_freqs.weight`, llama.cpp's form of llama3 scaling).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """The rope settings of a HF config, old style (rope_theta + rope_scaling) or new."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(hf_config, rotary_dim: int) -> torch.Tensor:
    """(rotary_dim // 2,) float32 inverse frequencies after scaling."""
    params = rope_parameters(hf_config)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3 are)")


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
    def __init__(self, hf_config, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.inv_freq = compute_inv_freq(hf_config, head_dim)
        self._last_lookup: tuple | None = None
        self._build_cache()

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF's rope_freqs: each inverse frequency is divided by its factor."""
        self.inv_freq = self.inv_freq / factors.float().to(self.inv_freq.device)
        self._build_cache()

    def _build_cache(self) -> None:
        positions = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, self.inv_freq)  # (max_position, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        signed = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
        device = getattr(self, "cos_cache", torch.empty(0)).device
        self.register_buffer("cos_cache", emb.cos().to(device), persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin
        self.register_buffer("signed_sin_cache", (emb.sin() * signed).to(device), persistent=False)
        self._last_lookup = None

    def forward(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """positions (T,); heads (T, num_heads, D): every head of a token is rotated by its
        position (callers pass q's and k's heads together, one pass for both).

        Hugging Face computes x * cos + rotate_half(x) * sin with rotate_half(x) =
        cat(-x2, x1); the same products come from roll(x, D/2) = cat(x2, x1) times sin
        with its first half negated: two fewer ops, same roundings."""
        cos, signed_sin = self._cos_sin(positions, heads.dtype)
        return heads * cos + heads.roll(self.head_dim // 2, dims=-1) * signed_sin

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, D) cos and signed sin of `positions`. Every layer of a step gets the same
        positions tensor, so they are looked up once per step: the last lookup is kept with a
        reference to its positions tensor (identity, not value, decides a hit)."""
        compiling = torch.compiler.is_compiling()  # the compiled graph computes it once anyway
        last = self._last_lookup
        if not compiling and last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        signed_sin = self.signed_sin_cache[positions].unsqueeze(1).to(dtype)
        if not compiling:
            self._last_lookup = (positions, dtype, cos, signed_sin)
        return cos, signed_sin

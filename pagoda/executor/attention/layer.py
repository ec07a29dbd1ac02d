"""The Attention layer models call: it reads the step's metadata from the forward context."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.attention.backend import AttentionBackend
from pagoda.executor.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner once the paged cache is allocated:
        # kv_cache shaped by the backend's kv_cache_shape().
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) -> (T, H * D)."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner binds one")
        metadata = get_forward_context()
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

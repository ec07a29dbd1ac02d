"""The Attention layer models call: it reads the step's metadata from the forward context.

Under torch.compile (`--compile`) the layer is one opaque custom op, `pagoda::attention`:
the compiled graph fuses everything around it, while the paged-cache write and read (and
the per-step metadata, which changes every step) stay out of the graph and its guards.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from pagoda.executor.attention.backend import AttentionBackend
from pagoda.executor.attention.kv_quant import QuantizedKVCache, rotate_keys, unrotate_keys
from pagoda.executor.forward_context import get_forward_context
from pagoda.executor.layers.linear import default_weight_loader

_layers: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_next_layer_id = itertools.count()


class Attention(nn.Module):
    """`sliding_window`: this layer's window, for models that mix windowed and global layers
    (Gemma 2/3); None takes the backend's, the model-wide window the runner set (Mistral).
    `logit_softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
    `sinks`: the layer has `sinks` (num_heads,), a learned logit per head that takes a share
    of each row's softmax (gpt-oss; the checkpoint fills it).
    `chunk`: chunked local attention (Llama 4): a query at position p sees only the keys of
    its own chunk, positions p // chunk * chunk .. p.
    `values_in_keys`: the layer's values are its keys (DeepSeek's latent attention, whose
    callers drop the features past the value's): the cache holds one plane, the keys, and
    reads take them as the values too."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None,
        sinks: bool = False, values_in_keys: bool = False, chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.values_in_keys, self.chunk = values_in_keys, chunk
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = default_weight_loader
        # Bound by the model runner once the paged cache is allocated:
        # kv_cache shaped by the backend's kv_cache_shape().
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # Which KV-cache group the layer's cache belongs to (one group unless the model has
        # sliding-window layers); the step's metadata is a list with one per group.
        self.kv_cache_group = 0
        self.layer_id = next(_next_layer_id)  # how the custom op finds this layer
        _layers[self.layer_id] = self

    @property
    def keys_window(self) -> int | None:
        """How far back any query of the layer reads: its sliding window or its chunk (the
        runner keeps only that many positions' blocks for it); None: every key."""
        return self.sliding_window or self.chunk

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) -> (T, H * D)."""
        if torch.compiler.is_compiling():
            return torch.ops.pagoda.attention(q, k, v, self.layer_id)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner binds one")
        metadata = get_forward_context()[self.kv_cache_group]  # (one per KV-cache group)
        rotated = isinstance(self.kv_cache, QuantizedKVCache)
        if rotated:  # keys stored rotated (kv_quant.py)
            q, k = rotate_keys(q), rotate_keys(k)
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale,
                                   window=self.sliding_window, softcap=self.logit_softcap,
                                   sinks=self.sinks, chunk=self.chunk)
        if rotated and self.values_in_keys:  # values read from the rotated keys
            out = unrotate_keys(out)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    # Writes this step's K/V into the layer's cache: a side effect on a tensor the graph never
    # sees, so no reordering can touch it; the op's output is always a fresh tensor.
    return _layers[layer_id].attend(q, k, v)


# Declared through the low-level torch.library API, like pagoda::gemm_q (kernels/ops.py):
# torch.library.custom_op's per-call checks cost a few microseconds more, 30 times a step.
_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor")
_library.impl("attention", _attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

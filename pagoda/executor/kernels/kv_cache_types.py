"""The KV caches the kernels read besides a plain one in the activations' dtype: the 8-bit
QuantizedKVCache (codes and one scale per row; how they are made and read in torch:
attention/kv_quant.py) and the 16-bit caches under float32 activations.

Plain data and torch dtypes only, so that kernels/ops.py and the attention backends share
the types without the kernels importing the attention package (kernels/ sits below
attention/: tests/engine/test_layering.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIXTEEN_BIT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""--kv-cache-dtype values that store plain 16-bit values under float32 activations."""


@dataclass
class QuantizedKVCache:
    """One layer's 8-bit cache (attention/kv_quant.py's docstring has the layout); backends
    take it where they take a float cache tensor."""

    codes: torch.Tensor
    """(2, num_kv_heads, num_blocks, block_size, head_dim) int8 / uint8"""
    scales: torch.Tensor
    """(2, num_kv_heads, num_blocks, block_size) bfloat16"""
    kv_cache_dtype: str
    """int8, fp8_e4m3 or fp8_e5m2"""

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

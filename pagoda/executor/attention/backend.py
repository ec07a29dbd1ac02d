"""The attention-backend interface shared by every backend.

A backend does two things:
- `build_metadata`, once per step: turn the scheduled sequences (how many tokens each has
  computed, how many it computes now, its block table) into tensors on the device;
- `forward`, once per layer: write this step's K/V into the paged cache by slot mapping,
  then attend each query token to its sequence's cached K/V through the block table.

Token t of a sequence lives in block block_table[t // block_size], row t % block_size, i.e.
flat slot block_table[t // block_size] * block_size + t % block_size. How a layer's cache
tensor is laid out is the backend's choice (`kv_cache_shape`).

The torch backend (torch_backend.py) runs on any device and is the reference for faster ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: flat cache slot each new token's K/V is written to."""
    positions: torch.Tensor
    """(num_tokens,) int64: position of each new token in its sequence."""
    query_start_loc: np.ndarray
    """(num_seqs + 1,) host ints: sequence i's tokens are [query_start_loc[i], query_start_loc[i+1])."""
    seq_lens: np.ndarray
    """(num_seqs,) host ints: tokens in the cache for each sequence once this step is done."""
    backend_data: Any = None
    """Whatever the backend precomputed for its forward (index tensors, masks)."""


class AttentionBackend(ABC):
    name: str = "abstract"

    def __init__(self, block_size: int, device: torch.device, sliding_window: int | None = None):
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window

    def build_metadata(
        self,
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        block_tables: np.ndarray,
    ) -> AttentionMetadata:
        """num_computed_tokens, num_scheduled_tokens: (num_seqs,) ints;
        block_tables: (num_seqs, max_blocks) ints, padded with 0 past each table's end."""
        query_lens = num_scheduled_tokens.astype(np.int64)
        seq_lens = num_computed_tokens.astype(np.int64) + query_lens
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Sequence index and in-sequence position of every new token, without a Python loop.
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        offset_in_query = np.arange(num_tokens) - query_start_loc[seq_of_token]
        positions = num_computed_tokens[seq_of_token] + offset_in_query
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        metadata = AttentionMetadata(
            num_tokens=num_tokens,
            slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(self.device),
            positions=torch.from_numpy(positions.astype(np.int64)).to(self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
        metadata.backend_data = self.prepare(metadata, query_lens, block_tables)
        return metadata

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple:
        """Shape of one layer's cache tensor; called once, when the runner allocates it.
        `planes`: 2 (keys and values) or 1 (keys only: layers whose values are their keys)."""

    @abstractmethod
    def prepare(
        self, metadata: AttentionMetadata, query_lens: np.ndarray, block_tables: np.ndarray
    ) -> Any:
        """Precompute per-step tensors the backend's forward needs (called once per step)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """query (num_tokens, num_heads, head_dim); key, value (num_tokens, num_kv_heads, head_dim);
        returns (num_tokens, num_heads, head_dim).

        `window`: the calling layer's sliding window, None for the backend's own
        (`self.sliding_window`); `softcap`: tanh soft-capping of the scores (Gemma 2);
        `sinks` (num_heads,): a learned logit per head that joins each row's softmax and is
        dropped after it (gpt-oss); `chunk`: each query sees only its own chunk's keys
        (Llama 4's chunked local attention)."""

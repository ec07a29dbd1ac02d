"""Reference attention over the paged KV cache in plain torch; runs on any device.

Sequences are split into two groups, decodes (one query token) and prefills (several), so a
long prompt in the batch does not pad every decode row to its length. Within a group the
queries are padded to (num_seqs, max_query_len) and each sequence's K/V is gathered through
its block table into (num_seqs, max_seq_len); one scaled_dot_product_attention call with a
boolean mask then covers the group:

    query row i of sequence s sits at position  p = seq_len[s] - query_len[s] + i
    it may attend to key positions             j <= p, j < seq_len[s]  (and p - j < window)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.executor.attention.backend import AttentionBackend, AttentionMetadata, write_kv_cache


@dataclass
class PaddedGroup:
    num_seqs: int
    max_query_len: int
    query_token_index: torch.Tensor
    """(num_seqs * max_query_len,) flat token gathered into each padded query row (0 for padding)."""
    valid_rows: torch.Tensor
    """(n,) padded rows that hold a real token, in token order."""
    output_token_index: torch.Tensor
    """(n,) the flat token each valid row belongs to."""
    kv_slots: torch.Tensor
    """(num_seqs, max_seq_len) cache slot of each key position."""
    mask: torch.Tensor
    """(num_seqs, 1, max_query_len, max_seq_len) bool, True where attention is allowed."""


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(
        self, metadata: AttentionMetadata, query_lens: np.ndarray, block_tables: np.ndarray
    ) -> list[PaddedGroup]:
        is_decode = query_lens == 1
        groups = []
        for members in (np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]):
            if len(members):
                groups.append(self._padded_group(metadata, query_lens, block_tables, members))
        return groups

    def _padded_group(
        self,
        metadata: AttentionMetadata,
        query_lens: np.ndarray,
        block_tables: np.ndarray,
        members: np.ndarray,
    ) -> PaddedGroup:
        bs = self.block_size
        q_lens = query_lens[members]
        seq_lens = metadata.seq_lens[members]
        starts = metadata.query_start_loc[members]
        max_q, max_kv = int(q_lens.max()), int(seq_lens.max())
        row = np.arange(max_q)
        row_valid = row[None, :] < q_lens[:, None]  # (S, Q)
        token_index = np.where(row_valid, starts[:, None] + row[None, :], 0)
        kv_pos = np.arange(max_kv)
        kv_slots = block_tables[members][:, kv_pos // bs] * bs + kv_pos % bs  # (S, L)
        # Key positions past a sequence's end read its position 0 instead: the cache is not
        # zeroed, and a masked NaN would still poison softmax(...) @ V.
        kv_slots = np.where(kv_pos[None, :] < seq_lens[:, None], kv_slots, kv_slots[:, :1])
        q_pos = (seq_lens - q_lens)[:, None] + row[None, :]  # (S, Q)
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (
            kv_pos[None, None, :] < seq_lens[:, None, None]
        )
        if self.sliding_window is not None:
            mask &= q_pos[:, :, None] - kv_pos[None, None, :] < self.sliding_window
        # Padding rows attend to position 0 so that softmax stays finite; they are dropped.
        mask[:, :, 0] |= ~row_valid
        flat_valid = row_valid.reshape(-1)
        dev = self.device
        return PaddedGroup(
            num_seqs=len(members),
            max_query_len=max_q,
            query_token_index=torch.from_numpy(token_index.reshape(-1)).to(dev),
            valid_rows=torch.from_numpy(np.nonzero(flat_valid)[0]).to(dev),
            output_token_index=torch.from_numpy(token_index.reshape(-1)[flat_valid]).to(dev),
            kv_slots=torch.from_numpy(kv_slots.astype(np.int64)).to(dev),
            mask=torch.from_numpy(mask[:, None]).to(dev),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key.shape[1]
        key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
        output = torch.empty_like(query)
        group: PaddedGroup
        for group in metadata.backend_data:
            s, q_len = group.num_seqs, group.max_query_len
            if q_len == 1:
                k = key_slots[group.kv_slots]  # (S, L, Hkv, D)
                v = value_slots[group.kv_slots]
                q = query[group.query_token_index]  # (S, H, D)
                output[group.output_token_index] = _decode_attention(q, k, v, group.mask, scale)
                continue
            # (S, H, Q, D)
            q = query[group.query_token_index].view(s, q_len, num_heads, head_dim).transpose(1, 2)
            # (S, Hkv, L, D)
            k = key_slots[group.kv_slots].transpose(1, 2)
            v = value_slots[group.kv_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_kv_heads != num_heads
            )
            out = out.transpose(1, 2).reshape(s * q_len, num_heads, head_dim)
            output[group.output_token_index] = out[group.valid_rows]
        return output


def _decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence, as two batched matmuls (the fused CPU kernel is slow
    for a single query row). query (S, H, D); key/value (S, L, Hkv, D); mask (S, 1, 1, L).

    Query heads are grouped by the KV head they share: (S, Hkv, group, D)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, key.permute(0, 2, 3, 1)).float() * scale  # (S, Hkv, G, L)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value.transpose(1, 2))  # (S, Hkv, G, D)
    return out.reshape(num_seqs, num_heads, head_dim)

"""Reference attention over the paged KV cache in plain torch; runs on any device.

Cache layout of one layer, head-major so that a block of one KV head is one contiguous
(block_size, head_dim) tile:

    kv_cache (2, num_kv_heads, num_blocks, block_size, head_dim)      [0] = K, [1] = V
             (1, ...) for layers whose values are their keys (DeepSeek's latent): [0] = K = V

Reading a sequence's keys is then one `index_select` of whole tiles through its block table
(no per-token gather, no transposing copy): for KV head h and block b the tile is row
h * num_blocks + b of kv_cache[0].view(num_kv_heads * num_blocks, block_size, head_dim), and
the tiles of a sequence's blocks, in table order, are its keys 0 .. L-1 (L = blocks x
block_size). Key positions past a sequence's end hold stale or zero values and are masked;
the cache is zero-initialised so those values are always finite (a masked NaN would still
poison softmax(...) @ V).

An 8-bit cache (`--kv-cache-dtype`, kv_quant.py) is a QuantizedKVCache of the same shape:
writes quantize each new row, reads dequantize the gathered tiles (never the whole cache).

Sequences are split into two groups, decodes (one query token) and prefills (several), so a
long prompt in the batch does not pad every decode row to its length:

    query row i of sequence s sits at position  p = seq_len[s] - query_len[s] + i
    it may attend to key positions             j <= p, j < seq_len[s]  (and p - j < window)

Decodes run as two batched matmuls over (kv_head x sequence) rows; prefills as one padded
scaled_dot_product_attention call, or, with soft-capped scores (Gemma 2) or attention sinks
(gpt-oss), which SDPA cannot do, as explicit matmuls over slices of query rows.

A sink is a learned logit per query head that joins every row's softmax as one more
column and is then dropped: it takes a share of the probability mass, so a row may attend
to nothing much (out = sum_j p_j v_j with sum_j p_j < 1).

A layer may bring its own window (models that interleave windowed and global layers), or
chunks (Llama 4: a query at p sees keys p // chunk * chunk .. p): each group builds the mask
of a window or chunk size the first time a layer asks for it in the step, and the other
layers of the step reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagoda.executor.attention.kv_quant import QuantizedKVCache, dequantize, quantize


@dataclass
class AttentionGroup:
    num_seqs: int
    max_query_len: int
    num_key_positions: int
    """L: the gathered blocks' positions, max blocks over the group x block_size."""
    tile_index: torch.Tensor
    """(num_kv_heads * num_seqs * blocks,) rows of the (num_kv_heads * num_blocks) tile view,
    ordered kv head, then sequence, then block."""
    query_token_index: torch.Tensor | None
    """(num_seqs * max_query_len,) flat token of each padded query row (0 for padding);
    None when the group is the whole batch in order with one token each (no gather needed)."""
    valid_rows: torch.Tensor
    """(n,) padded rows that hold a real token, in token order."""
    output_token_index: torch.Tensor | None
    """(n,) the flat token each valid row belongs to; None as for query_token_index."""
    mask: torch.Tensor | None
    """Decodes: (num_seqs, L) float, 0 where allowed and -inf elsewhere.
    Prefills: (num_seqs, 1, max_query_len, L) bool, True where allowed; None when all of the
    group's prompts start at position 0 without a sliding window (plain causal attention).
    For the backend's own window; `TorchAttentionBackend.mask` builds others."""
    allowed: np.ndarray
    """(num_seqs, max_query_len, L) bool: causal and within the sequence, no window."""
    query_positions: np.ndarray
    """(num_seqs, max_query_len) position of each padded query row."""
    row_valid: np.ndarray
    """(num_seqs, max_query_len) bool: the row holds a real token."""
    starts_at_zero: bool
    """Every sequence of the group computes its whole prompt in this step."""
    masks: dict
    """(window, explicit) -> mask, built on first use within the step."""


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int, device: torch.device, sliding_window: int | None = None):
        super().__init__(block_size, device, sliding_window)
        self.num_blocks = 0
        self.num_kv_heads = 0

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple:
        """(planes, num_kv_heads, num_blocks, block_size, head_dim); see the module
        docstring."""
        self.num_blocks, self.num_kv_heads = num_blocks, num_kv_heads
        return (planes, num_kv_heads, num_blocks, self.block_size, head_dim)

    def prepare(
        self, metadata: AttentionMetadata, query_lens: np.ndarray, block_tables: np.ndarray
    ) -> list[AttentionGroup]:
        is_decode = query_lens == 1
        groups = []
        for members in (np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]):
            if len(members):
                groups.append(self._group(metadata, query_lens, block_tables, members))
        return groups

    def _group(
        self,
        metadata: AttentionMetadata,
        query_lens: np.ndarray,
        block_tables: np.ndarray,
        members: np.ndarray,
    ) -> AttentionGroup:
        bs = self.block_size
        q_lens = query_lens[members]
        seq_lens = metadata.seq_lens[members]
        starts = metadata.query_start_loc[members]
        max_q = int(q_lens.max())
        blocks = -(-int(seq_lens.max()) // bs)
        num_keys = blocks * bs
        tables = block_tables[members][:, :blocks]  # (S, blocks), 0-padded past each end
        head_offsets = np.arange(self.num_kv_heads, dtype=np.int64) * self.num_blocks
        tile_index = (head_offsets[:, None, None] + tables[None]).reshape(-1)

        row = np.arange(max_q)
        row_valid = row[None, :] < q_lens[:, None]  # (S, Q)
        token_index = np.where(row_valid, starts[:, None] + row[None, :], 0)
        kv_pos = np.arange(num_keys)
        q_pos = (seq_lens - q_lens)[:, None] + row[None, :]  # (S, Q)
        allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (
            kv_pos[None, None, :] < seq_lens[:, None, None]
        )  # (S, Q, L)
        dev = self.device
        flat_valid = row_valid.reshape(-1)
        whole_batch = max_q == 1 and len(members) == metadata.num_tokens
        group = AttentionGroup(
            num_seqs=len(members),
            max_query_len=max_q,
            num_key_positions=num_keys,
            tile_index=torch.from_numpy(tile_index).to(dev),
            query_token_index=None if whole_batch else torch.from_numpy(token_index.reshape(-1)).to(dev),
            valid_rows=torch.from_numpy(np.nonzero(flat_valid)[0]).to(dev),
            output_token_index=(
                None if whole_batch else torch.from_numpy(token_index.reshape(-1)[flat_valid]).to(dev)
            ),
            mask=None,
            allowed=allowed,
            query_positions=q_pos,
            row_valid=row_valid,
            starts_at_zero=bool(np.array_equal(seq_lens, q_lens)),
            masks={},
        )
        group.mask = self.mask(group, self.sliding_window)
        return group

    def mask(
        self, group: AttentionGroup, window: int | None, explicit: bool = False,
        chunk: int | None = None,
    ) -> torch.Tensor | None:
        """The group's mask (see AttentionGroup.mask) for `window` or `chunk`; `explicit`:
        never None (the soft-capped path has no is_causal shortcut). Built once per step and
        window."""
        key = (window, explicit, chunk)
        if key in group.masks:
            return group.masks[key]
        allowed = group.allowed
        kv_pos = np.arange(group.num_key_positions)
        if window is not None:
            allowed = allowed & (group.query_positions[:, :, None] - kv_pos[None, None, :] < window)
        if chunk is not None:
            allowed = allowed & (group.query_positions[:, :, None] // chunk
                                 == kv_pos[None, None, :] // chunk)
        if group.max_query_len == 1:
            mask = torch.from_numpy(np.where(allowed[:, 0], 0.0, -np.inf).astype(np.float32))
        elif window is None and chunk is None and group.starts_at_zero and not explicit:
            # Every prompt starts at position 0: query row r attends keys 0..r, which is
            # is_causal's top-left mask; padding rows see stale (finite) keys and are dropped.
            # Same result, bit for bit, and the flash kernel skips the masked half.
            mask = None
        else:
            # Padding rows attend to position 0 so that softmax stays finite; they are dropped.
            allowed = allowed.copy()
            allowed[:, :, 0] |= ~group.row_valid
            mask = torch.from_numpy(allowed[:, None])
        mask = None if mask is None else mask.to(self.device)
        group.masks[key] = mask
        return mask

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
        window = self.sliding_window if window is None else window
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        groups: list[AttentionGroup] = metadata.backend_data
        output = None if len(groups) == 1 and groups[0].output_token_index is None else (
            torch.empty_like(query)
        )
        for group in groups:
            q = query if group.query_token_index is None else query[group.query_token_index]
            if group.max_query_len == 1:
                out = self.decode(q, kv_cache, group, scale, window, softcap, sinks, chunk)
                if output is None:
                    return out
                output[group.output_token_index] = out
            else:
                output[group.output_token_index] = self.prefill(
                    q, kv_cache, group, scale, window, softcap, sinks, chunk)
        return output

    @staticmethod
    def _gather(kv_cache: torch.Tensor | QuantizedKVCache, group: AttentionGroup,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, (Hkv * S, L, D): kv head major, then sequence. From
        an 8-bit cache, the gathered tiles (only those) dequantized to `dtype`."""
        planes, num_kv_heads, _, block_size, head_dim = kv_cache.shape
        rows = num_kv_heads * group.num_seqs
        if isinstance(kv_cache, QuantizedKVCache):
            tiles = [dequantize(
                kv_cache.codes[i].view(-1, block_size, head_dim).index_select(0, group.tile_index),
                kv_cache.scales[i].view(-1, block_size).index_select(0, group.tile_index),
                kv_cache.kv_cache_dtype, dtype,
            ).view(rows, -1, head_dim) for i in range(planes)]
        else:  # a 16-bit cache under float32 activations: the gathered tiles widened
            tiles = [kv_cache[i].view(-1, block_size, head_dim).index_select(0, group.tile_index)
                     .view(rows, -1, head_dim).to(dtype) for i in range(planes)]
        return tiles[0], tiles[-1]  # (one plane: the keys are the values)

    def prefill(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None, chunk: int | None = None,
    ) -> torch.Tensor:
        """The prefill group's attention: query (S * max_query_len, H, D), padded rows
        included -> (valid rows, H, D), one padded scaled_dot_product_attention call (explicit
        matmuls with soft-capping or sinks)."""
        num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
        k, v = self._gather(kv_cache, group, query.dtype)
        s, q_len, num_heads = group.num_seqs, group.max_query_len, query.shape[1]
        q = query.view(s, q_len, num_heads, head_dim).transpose(1, 2)  # (S, H, Q, D)
        k = k.view(num_kv_heads, s, -1, head_dim).transpose(0, 1)  # (S, Hkv, L, D)
        v = v.view(num_kv_heads, s, -1, head_dim).transpose(0, 1)
        explicit = softcap is not None or sinks is not None
        mask = self.mask(group, window, explicit=explicit, chunk=chunk)
        if explicit:
            out = _explicit_attention(q, k, v, mask, scale, softcap, sinks)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=num_kv_heads != num_heads,
            )
        return out.transpose(1, 2).reshape(s * q_len, num_heads, head_dim)[group.valid_rows]

    def decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None, chunk: int | None = None,
    ) -> torch.Tensor:
        """The decode group's attention: query (S, H, D) -> (S, H, D). Gathers each
        sequence's key/value tiles, then two batched matmuls (`_decode_attention`)."""
        k, v = self._gather(kv_cache, group, query.dtype)
        mask = self.mask(group, window, chunk=chunk)
        return _decode_attention(query, k, v, mask, scale, kv_cache.shape[1], softcap, sinks)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V (T, Hkv, D) at their flat slots (block * block_size + row); a
    one-plane cache (values are keys) the keys only.
    index_put_, not index_copy_: on CPU index_copy_ wrote every page of the layer's cache
    (RSS grew by the whole cache at the first prefill), index_put_ only the rows it stores.
    An 8-bit cache takes each row's codes and scale (kv_quant.quantize), a 16-bit one under
    float32 activations the values rounded to nearest even."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    index = (slice(None), slot_mapping)
    planes = (key, value)[:kv_cache.shape[0]]
    if isinstance(kv_cache, QuantizedKVCache):
        for i, rows in enumerate(planes):
            codes, scales = quantize(rows.transpose(0, 1), kv_cache.kv_cache_dtype)
            kv_cache.codes[i].view(num_kv_heads, -1, head_dim)[index] = codes
            kv_cache.scales[i].view(num_kv_heads, -1)[index] = scales
        return
    for i, rows in enumerate(planes):
        kv_cache[i].view(num_kv_heads, -1, head_dim)[index] = rows.transpose(0, 1).to(kv_cache.dtype)


def _decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence as two batched matmuls (the fused CPU kernel is slow for
    a single query row). query (S, H, D); key/value (Hkv * S, L, D); mask (S, L) additive;
    sinks (H,) or None.

    Query heads are grouped by the KV head they share: rows (Hkv * S, group, D)."""
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    q = q.reshape(num_kv_heads * num_seqs, group, head_dim)
    scores = torch.bmm(q, key.transpose(1, 2)).float()  # (Hkv * S, G, L)
    scores = scores.view(num_kv_heads, num_seqs, group, -1).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.add_(mask[:, None, :])
    probs = _softmax(scores, sinks, (num_kv_heads, 1, group, 1)).to(value.dtype)
    probs = probs.reshape(num_kv_heads * num_seqs, group, -1)
    out = torch.bmm(probs, value)  # (Hkv * S, G, D)
    return out.view(num_kv_heads, num_seqs, num_heads // num_kv_heads, head_dim).transpose(0, 1).reshape(
        num_seqs, num_heads, head_dim
    )


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, sink_shape: tuple) -> torch.Tensor:
    """softmax over the last dim of float32 `scores`; with `sinks` (H,), each row's head's
    sink (viewed as `sink_shape`, broadcast to the rows) joins the softmax as one more
    column, then is dropped (the module docstring)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(sink_shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


EXPLICIT_SCORES_PER_SLICE = 1 << 24
"""Float32 scores the explicit prefill holds at once (64 MiB): query rows are taken in
slices of this size, so a long prompt does not need its whole (H, Q, L) score tensor."""


def _explicit_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
    scale: float, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with the scores written out: scale * q.k, then softcap * tanh(s / softcap)
    where `softcap`, in Hugging Face's order (scale, cap, then mask), softmax in float32
    with `sinks` (H,) where given. query (S, H, Q, D); key/value (S, Hkv, L, D);
    allowed (S, 1, Q, L) bool -> (S, H, Q, D)."""
    num_seqs, num_heads, q_len, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    q = query.reshape(num_seqs, num_kv_heads, group, q_len, head_dim)
    out = torch.empty_like(query).view(num_seqs, num_kv_heads, group, q_len, head_dim)
    rows = max(1, EXPLICIT_SCORES_PER_SLICE // (num_seqs * num_heads * num_keys))
    for start in range(0, q_len, rows):
        end = min(q_len, start + rows)
        # (S, Hkv, G * rows, D) @ (S, Hkv, D, L): the query heads sharing a KV head together
        q_slice = q[:, :, :, start:end].reshape(num_seqs, num_kv_heads, -1, head_dim)
        scores = torch.matmul(q_slice, key.transpose(-1, -2)).float()
        scores = scores.view(num_seqs, num_kv_heads, group, end - start, num_keys)
        scores = scores.mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~allowed[:, :, None, start:end], float("-inf"))
        probs = _softmax(scores, sinks, (1, num_kv_heads, group, 1, 1)).to(value.dtype)
        probs = probs.reshape(num_seqs, num_kv_heads, -1, num_keys)
        out[:, :, :, start:end] = torch.matmul(probs, value).view(
            num_seqs, num_kv_heads, group, end - start, head_dim)
    return out.view(num_seqs, num_heads, q_len, head_dim)

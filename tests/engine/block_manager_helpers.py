"""Shared by the block manager tests: tiny requests, the scheduler's admission in one call,
and an independent recomputation of the block hash."""

from __future__ import annotations

import xxhash

from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.core.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=16), eos_token_ids=[0])


def admit(bm: BlockManager, request: Request) -> list[int] | None:
    """What the scheduler does, through the KVCacheManager, to this full-attention group's pool
    for a new request taking its whole prompt in one step."""
    hits, num_hit_tokens = bm.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    new_ids = bm.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new_ids is None:
        request.num_computed_tokens = 0
    return new_ids


def finish_step(request: Request, num_new: int, sampled: int | None = None) -> None:
    """What update_from_output does after the forward."""
    request.num_computed_tokens += num_new
    if sampled is not None:
        request.append_output_token(sampled)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def reference_hash(parent: int, tokens: list[int]) -> int:
    """Independent recomputation: xxh3_128 over 16-byte LE parent hash + int64 LE token ids."""
    data = parent.to_bytes(16, "little") + b"".join(
        t.to_bytes(8, "little", signed=True) for t in tokens
    )
    return xxhash.xxh3_128(data).intdigest()


PROMPT_A = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 2 full blocks + 2 tokens

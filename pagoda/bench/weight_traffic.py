"""How close single-stream decoding comes to the memory bound: the weight bytes one decode step
reads, and this machine's memory read bandwidth, measured by the same command.

At one stream a decode step reads every weight once (a matrix-vector product per layer), so
weight bytes x decode tokens/s is the weight traffic, and its share of the measured read
bandwidth says how much faster decoding could still get. Lookup tables are not counted: the
input embedding and the rotary caches give one row per token (unless the embedding is also
the output head, which reads all of it); nor is the KV cache (small at short contexts). A
sparse MoE layer's token reads the top_k experts it chose, so each expert's bytes count
top_k / num_experts of themselves (a block's experts are all one size): the bytes read per
token on average, whichever experts a token picks.
"""

from __future__ import annotations

import time

import torch
from torch import nn

READ_TEST_BYTES = 512 * 2**20
"""The read test's buffer: far larger than any CPU's last-level cache."""


def _tensors(module: nn.Module):
    """The module's own weights: parameters, persistent buffers, and the planes of packed
    weights it holds (alone or in a list)."""
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield buffer
    for parameter in module._parameters.values():
        if parameter is not None:
            yield parameter
    for value in vars(module).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            planes = getattr(item, "planes", None)
            if isinstance(planes, dict):
                yield from planes.values()


def _is_lookup_table(module: nn.Module) -> bool:
    return hasattr(module, "num_embeddings")  # nn.Embedding, packed and vocab-parallel ones


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one single-stream decode step reads (see the module text)."""
    seen: set[int] = set()
    total = 0.0
    share = _expert_shares(model)

    def count(tensor: torch.Tensor, fraction: float = 1.0) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes() * fraction

    for module in model.modules():
        if not _is_lookup_table(module):
            for tensor in _tensors(module):
                count(tensor, share.get(id(module), 1.0))
    if getattr(model, "lm_head", None) is None and getattr(model, "quantized_head", None) is None:
        # a tied float head: x @ embedding^T reads the whole (first, the input) table
        embedding = next(m for m in model.modules() if _is_lookup_table(m))
        for tensor in _tensors(embedding):
            count(tensor)
    return round(total)


def _expert_shares(model: nn.Module) -> dict[int, float]:
    """id(module) -> top_k / num_experts for every module inside a sparse MoE block's routed
    experts."""
    from pagoda.executor.layers.moe import routed_expert_modules

    return {id(module): block.top_k / len(block.experts)
            for block, _, module in routed_expert_modules(model)}


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second this process reads from memory: the best of `repeats` sums over a
    READ_TEST_BYTES float32 buffer, on torch's threads (the ones decoding runs on)."""
    buffer = torch.ones(READ_TEST_BYTES // 4, dtype=torch.float32)
    buffer.sum()  # pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return READ_TEST_BYTES / best

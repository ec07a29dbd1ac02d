"""One layer's decode attention deep into a context: Pagoda's C kernel (`paged_attention`)
on one query token against DEPTH keys, per KV-cache dtype (BENCHMARKS.md section 33).

    python benchmarks/attention_depth.py [--depth 16384] [--kv float32 float16 bfloat16 int8]
        [--order shuffled|consecutive] [--heads 32 8 64]

Keys sit in blocks of 16 in a shuffled order (a long-running server's pool) or in
consecutive blocks. Prints the best of --repeats calls per dtype, in ms, and the bytes one
call reads. Run it with PYTHONPATH set to another checkout to time that checkout's kernel.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagoda.executor.attention.kv_quant import QuantizedKVCache
from pagoda.executor.kernels.ops import paged_attention

BLOCK_SIZE = 16


def cache_of(kind: str, num_kv_heads: int, num_blocks: int, head_dim: int):
    shape = (2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    if kind in ("float32", "float16", "bfloat16"):
        return torch.randn(shape).to(getattr(torch, kind))
    codes = torch.randint(-127, 128, shape, dtype=torch.int8)
    return QuantizedKVCache(codes, torch.full(shape[:-1], 0.01, dtype=torch.bfloat16), kind)


def cache_bytes(cache) -> int:
    if isinstance(cache, QuantizedKVCache):
        return cache.codes.numel() + 2 * cache.scales.numel()
    return cache.numel() * cache.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=16384)
    parser.add_argument("--kv", nargs="+", default=["float32", "float16", "bfloat16", "int8"])
    parser.add_argument("--order", choices=["shuffled", "consecutive"], default="shuffled")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64],
                        metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    num_heads, num_kv_heads, head_dim = args.heads
    used = -(-args.depth // BLOCK_SIZE)
    num_blocks = used + 2
    torch.manual_seed(0)
    order = torch.randperm(num_blocks) if args.order == "shuffled" else torch.arange(num_blocks)
    table = order[:used].view(1, -1).to(torch.int64).contiguous()
    query = torch.randn(1, num_heads, head_dim)
    query_seq, key_lens = torch.zeros(1, dtype=torch.int64), torch.tensor([args.depth])
    for kind in args.kv:
        try:
            cache = cache_of(kind, num_kv_heads, num_blocks, head_dim)

            def call(cache=cache):
                return paged_attention(query, cache, table, query_seq, key_lens,
                                       head_dim**-0.5, None)

            for _ in range(3):
                call()
        except (ValueError, AttributeError, TypeError) as error:  # an older checkout
            print(f"{kind:>9}: not supported here ({error})")
            continue
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        size = cache_bytes(cache) * used / num_blocks
        print(f"{kind:>9}: {best * 1e3:6.2f} ms a layer at depth {args.depth} ({args.order} "
              f"blocks), {size / 1e6:.0f} MB read, {size / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()

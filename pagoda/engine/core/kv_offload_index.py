"""The engine's view of the KV tiers below the KV cache (host memory, disk). Pure Python.

The tiers themselves live in the executor (pagoda/executor/kv_offload/: KVOffloadWorker);
the engine only knows which keys they hold, and queues the copies each step carries:

    kv_saves  (key, block_id, persistent)   pool block -> tiers, before the step's forward
    kv_loads  (key, block_id)               tiers -> pool block, before the step's forward
    kv_drops  key                           swap entries consumed (or given up)

Keys
    A prefix block's key is its chained block hash (block_manager.py); such entries are
    persistent (host tier, then disk). A preempted request's blocks (--preemption-mode swap)
    get swap keys (`swap_key`), host tier only, never written to disk.

The index (`keys`) holds the persistent keys the tiers are believed to hold: a key is added
when its save is issued, and removed when the runner reports it evicted from every tier
(kv_offload_dropped) or missing at a load (kv_load_failures). It may claim a key the tiers
lost (a failed write): the load then fails and the block is recomputed, never used.

Swap room: swap entries must not be evicted by the host tier's LRU while their request
waits, so the engine admits a swap only while the swap bytes held stay within the host
tier's size (`swap_bytes_used` against `host_bytes`); otherwise the victim recomputes.
"""

from __future__ import annotations

import xxhash


def swap_key(request_id: str, block_index: int) -> int:
    """The key of block `block_index` of a preempted request's swap entries (distinct from
    every prefix hash in practice: 128-bit xxh3 of a tagged text)."""
    digest = xxhash.xxh3_128()
    digest.update(b"swap")
    digest.update(request_id.encode())
    digest.update(b"\0")
    digest.update(block_index.to_bytes(8, "little"))
    return digest.intdigest()


class KVOffloadIndex:
    def __init__(self, host_bytes: int, block_bytes: int) -> None:
        """`host_bytes`: the host tier's size (--kv-offload-memory); `block_bytes`: one KV
        block's payload (every layer's K and V of block_size tokens, scales included)."""
        self.host_bytes = host_bytes
        self.block_bytes = block_bytes
        self.keys: set[int] = set()
        """Persistent keys believed held by some tier."""
        self.saves: list[tuple[int, int, bool]] = []
        self.loads: list[tuple[int, int]] = []
        self.drops: list[int] = []
        self.swap_bytes_used = 0
        """Bytes of swap entries saved and not yet dropped."""
        # Counters (tokens / blocks), for metrics and tests.
        self.hit_tokens = 0
        """Prompt tokens found in the tiers at admission (loads issued for them)."""
        self.loaded_blocks = 0
        """Blocks loaded back successfully (prefix and swap)."""
        self.failed_loads = 0
        """Blocks whose load failed (recomputed)."""
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.swap_fallbacks = 0
        """Preemptions that recomputed because the host tier had no room for the swap."""
        self.stats: dict[str, int] = {}
        """The runner's tier counters (KVOffloadWorker.take_stats names), summed over steps."""

    def seed(self, keys) -> None:
        """Keys the disk tier holds at start (restart survival)."""
        self.keys.update(keys)

    def save_evicted(self, key: int, block_id: int) -> None:
        """A cached prefix block is about to be overwritten: keep it in the tiers, unless
        they hold its key already."""
        if key not in self.keys:
            self.keys.add(key)
            self.saves.append((key, block_id, True))

    def swap_room(self, num_blocks: int) -> bool:
        return self.swap_bytes_used + num_blocks * self.block_bytes <= self.host_bytes

    def save_swap(self, keys: list[int], block_ids: list[int]) -> None:
        self.saves.extend((key, block_id, False) for key, block_id in zip(keys, block_ids))
        self.swap_bytes_used += len(keys) * self.block_bytes
        self.swapped_out_blocks += len(keys)

    def drop_swap(self, keys: list[int]) -> None:
        self.drops.extend(keys)
        self.swap_bytes_used -= len(keys) * self.block_bytes

    def load(self, items: list[tuple[int, int]]) -> None:
        self.loads.extend(items)

    def take(self) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]], list[int]]:
        """The step's (saves, loads, drops), emptied here."""
        ops = self.saves, self.loads, self.drops
        self.saves, self.loads, self.drops = [], [], []
        return ops

    def forget(self, keys) -> None:
        """Keys the tiers no longer hold (evicted from every tier, or a failed load)."""
        self.keys.difference_update(keys)

    def add_stats(self, stats: dict[str, int] | None) -> None:
        for name, value in (stats or {}).items():
            self.stats[name] = self.stats.get(name, 0) + value

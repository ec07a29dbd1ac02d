"""The executor's side of the tiered prefix cache (issue 37): pool blocks to and from the
host-memory and disk tiers, as the engine's SchedulerOutput asks (kv_saves, kv_loads,
kv_drops) before a step's forward.

    save   pool block -> record (block_copy.py + record.py) -> host tier; what the host tier
           evicts goes to the disk tier (persistent entries; swap entries are dropped). A
           persistent record the host tier cannot hold goes straight to disk.
    load   host tier, else disk tier (a disk hit is promoted to the host tier) -> checked
           record -> pool block; a missing or broken record is a failed key (block untouched).
    flush  at shutdown: the pool's cached blocks and the host tier's persistent entries to
           disk, as many as the quota holds (pool blocks, the most recent, first).

A persistent key that leaves every tier (LRU, quota, a broken record, a failing disk) is
reported once by take_dropped, so the engine's tier index stays a superset of nothing:
every key it holds was in a tier when last reported. I/O never raises out of this class.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.executor.kv_offload import record as rec
from pagoda.executor.kv_offload.block_copy import BlockCopier
from pagoda.executor.kv_offload.disk_tier import DiskTier
from pagoda.executor.kv_offload.host_tier import HostTier

logger = logging.getLogger(__name__)

STAT_NAMES = (
    "host_hits", "host_misses", "disk_hits", "disk_misses",
    "host_bytes_written", "host_bytes_read", "disk_bytes_written", "disk_bytes_read",
    "host_evictions", "disk_evictions", "corrupt_entries", "disk_errors",
)
CHUNK_BYTES = 32 << 20
"""Most bytes of blocks the staging buffer (one gather or scatter) holds."""


@dataclass(frozen=True)
class KVOffloadConfig:
    host_bytes: int
    """Host-memory tier capacity in bytes (0: no host tier)."""
    disk_dir: str | None = None
    """Disk tier root (None: no disk tier); entries go in a folder per fingerprint."""
    disk_bytes: int = 0
    """Disk tier quota in bytes (> 0 when disk_dir is set)."""

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"KV offload host_bytes must be >= 0, got {self.host_bytes}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError(f"KV offload disk_bytes must be > 0 with a disk_dir "
                             f"({self.disk_dir!r}), got {self.disk_bytes}")


def layout_digest(fingerprint: str, layout: str) -> bytes:
    """What records carry and the disk folder is named by: the runner's fingerprint (model
    file, dtypes, block size, ...), the record format's version and the payload's layout."""
    return rec.fingerprint_digest(f"pagoda-kv-offload v{rec.FORMAT_VERSION}\n{fingerprint}\n"
                                  f"{layout}")


class KVOffloadWorker:
    def __init__(self, kv_caches: list, config: KVOffloadConfig, fingerprint: str) -> None:
        """`kv_caches`: the runner's per-layer caches (one full-attention group)."""
        self.copier = BlockCopier(kv_caches)
        self.payload_bytes = self.copier.payload_bytes
        self.record_bytes = rec.HEADER_BYTES + self.payload_bytes
        self.digest = layout_digest(fingerprint, self.copier.layout)
        self.stats: Counter = Counter()
        self.host = HostTier(config.host_bytes)
        self.disk = (DiskTier(config.disk_dir, self.digest, config.disk_bytes,
                              self.payload_bytes, self.stats)
                     if config.disk_dir is not None else None)
        self.dropped: list[int] = []
        self.chunk_blocks = max(1, CHUNK_BYTES // self.record_bytes)
        self.staging = torch.empty((0, self.record_bytes), dtype=torch.uint8)
        """(rows, record_bytes) records on their way between the caches and the tiers, kept
        (its pages stay mapped: a fresh buffer a step costs more in page faults than the
        copies themselves); grows to chunk_blocks rows."""
        if self.disk is not None:
            logger.info("KV offload disk tier %s: %d entries (%d bytes) of this model found",
                        self.disk.folder, len(self.disk.index), self.disk.used)

    # ---- the engine's view ---------------------------------------------------------------

    def known_keys(self) -> list[int]:
        """Persistent keys held in any tier (at start: the disk tier's valid entries)."""
        keys = dict.fromkeys(self.disk.keys() if self.disk is not None else [])
        keys.update(dict.fromkeys(self.host.keys()))
        return list(keys)

    def take_dropped(self) -> list[int]:
        """Persistent keys that left every tier since the last call."""
        dropped = [key for key in dict.fromkeys(self.dropped) if not self._held(key)]
        self.dropped = []
        return dropped

    def take_stats(self) -> dict[str, int]:
        """Counter deltas since the last call (every name of STAT_NAMES)."""
        stats = {name: self.stats[name] for name in STAT_NAMES}
        self.stats.clear()
        return stats

    def usage(self) -> dict[str, int]:
        """What the tiers hold now (for the web page's KV view)."""
        disk = self.disk
        return {
            "host_capacity_bytes": self.host.capacity, "host_used_bytes": self.host.used,
            "host_entries": len(self.host.persistent) + len(self.host.swap),
            "disk_capacity_bytes": disk.capacity if disk else 0,
            "disk_used_bytes": disk.used if disk else 0,
            "disk_entries": len(disk.index) if disk else 0,
            "disk_writable": int(bool(disk and disk.writable)),
        }

    # ---- steps -----------------------------------------------------------------------------

    def save(self, items: list[tuple[int, int, bool]]) -> None:
        """(key, block_id, persistent): copy each pool block into the tiers. A persistent key
        already held is only refreshed (its content is the same: the key is its hash)."""
        todo = []
        for key, block_id, persistent in items:
            rec.key_bytes(key)
            if persistent and self._held(key):
                self.host.touch(key)
                if self.disk is not None:
                    self.disk.touch(key)
                continue
            todo.append((key, block_id, persistent))
        for start in range(0, len(todo), self.chunk_blocks):
            chunk = todo[start:start + self.chunk_blocks]
            records = self._encode([key for key, _, _ in chunk], [b for _, b, _ in chunk])
            for (key, _, persistent), record in zip(chunk, records):
                self._store(key, record, persistent)

    def load(self, items: list[tuple[int, int]]) -> list[int]:
        """(key, block_id): copy each key's record into its pool block. Returns the keys
        that were missing or broken (their blocks are left as they were)."""
        failed = []
        for start in range(0, len(items), self.chunk_blocks):
            found = []
            for key, block_id in items[start:start + self.chunk_blocks]:
                record = self._find(key)
                if record is None:
                    failed.append(key)
                else:
                    found.append((block_id, record))
            if found:
                rows = self._rows(len(found))
                array = rows.numpy()
                for i, (_, record) in enumerate(found):
                    array[i] = np.frombuffer(record, dtype=np.uint8)
                self.copier.scatter([block_id for block_id, _ in found], rows, rec.HEADER_BYTES)
        return failed

    def drop(self, keys: list[int]) -> None:
        """Forget `keys` in every tier (consumed swap entries)."""
        for key in keys:
            self.host.remove(key)
            if self.disk is not None:
                self.disk.delete(key)

    def flush(self, items: list[tuple[int, int]]) -> None:
        """Shutdown: (key, block_id) of the pool's cached blocks, then the host tier's
        persistent entries (most recent first), to disk, as many as its quota holds; these
        become its most recent entries, the pool's blocks last."""
        disk = self.disk
        if disk is None or not disk.writable:
            return
        budget = disk.capacity // self.record_bytes
        plan: dict[int, int | None] = {}  # key -> pool block id (None: from the host tier)
        for key, block_id in items:
            rec.key_bytes(key)
            plan.setdefault(key, block_id)
        for key in reversed(self.host.keys()):
            plan.setdefault(key, None)
        chosen = list(plan.items())[:budget][::-1]  # least valuable first
        for key, _ in chosen:
            disk.touch(key)  # those already on disk stay clear of the evictions below
        from_host = [key for key, block_id in chosen if block_id is None and key not in disk]
        for key in from_host:
            self._write_disk(key, self.host.persistent[key])
        from_pool = [(key, block_id) for key, block_id in chosen
                     if block_id is not None and key not in disk]
        for start in range(0, len(from_pool), self.chunk_blocks):
            chunk = from_pool[start:start + self.chunk_blocks]
            records = self._encode([key for key, _ in chunk], [b for _, b in chunk])
            for (key, _), record in zip(chunk, records):
                if not self._write_disk(key, record) and not disk.writable:
                    return

    # ---- inside ----------------------------------------------------------------------------

    def _held(self, key: int) -> bool:
        return key in self.host.persistent or (self.disk is not None and key in self.disk)

    def _gone(self, key: int) -> None:
        """A persistent key may have left every tier: report it (take_dropped re-checks)."""
        if not self._held(key):
            self.dropped.append(key)

    def _rows(self, n: int) -> torch.Tensor:
        if self.staging.shape[0] < n:
            self.staging = torch.empty((n, self.record_bytes), dtype=torch.uint8)
        return self.staging[:n]

    def _encode(self, keys: list[int], block_ids: list[int]) -> list[bytes]:
        """Records of pool blocks `block_ids` under `keys`: one gather per plane."""
        rows = self._rows(len(keys))
        self.copier.gather(block_ids, rows, rec.HEADER_BYTES)
        array = rows.numpy()
        records = []
        for key, row in zip(keys, array):
            rec.write_header(row, key, self.digest)
            records.append(row.tobytes())
        return records

    def _store(self, key: int, record: bytes, persistent: bool) -> None:
        stored = False
        if self.host.capacity > 0:
            stored, evicted = self.host.put(key, record, persistent)
            if stored:
                self.stats["host_bytes_written"] += len(record)
            self._evicted(evicted)
        if persistent and not stored:
            self._write_disk(key, record)
            self._gone(key)

    def _evicted(self, evicted: list[tuple[int, bytes, bool]]) -> None:
        """Host-tier evictions: persistent entries go down to disk, swap entries are gone."""
        for key, record, persistent in evicted:
            self.stats["host_evictions"] += 1
            if persistent:
                if self.disk is None or key not in self.disk:
                    self._write_disk(key, record)
                self._gone(key)

    def _write_disk(self, key: int, record: bytes) -> bool:
        if self.disk is None:
            return False
        stored, evicted = self.disk.write(key, record)
        for old in evicted:
            self._gone(old)
        return stored

    def _find(self, key: int) -> bytes | None:
        """`key`'s checked record from the nearest tier, or None (counted as misses)."""
        found = self.host.get(key)
        if found is not None:
            record, persistent = found
            if rec.payload_of(record, key, self.digest, self.payload_bytes) is not None:
                self.stats["host_hits"] += 1
                self.stats["host_bytes_read"] += len(record)
                return record
            self.stats["corrupt_entries"] += 1
            self.host.remove(key)
            if persistent:
                self._gone(key)
        self.stats["host_misses"] += 1
        if self.disk is None:
            return None
        was_on_disk = key in self.disk
        record = self.disk.read(key)
        if record is None:
            self.stats["disk_misses"] += 1
            if was_on_disk:
                self._gone(key)
            return None
        self.stats["disk_hits"] += 1
        if self.host.capacity > 0:  # promote: it is hot again (and stays on disk)
            stored, evicted = self.host.put(key, record, True)
            if stored:
                self.stats["host_bytes_written"] += len(record)
            self._evicted(evicted)
        return record


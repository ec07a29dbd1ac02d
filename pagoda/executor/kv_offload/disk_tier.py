"""The disk tier: one file a record (record.py), LRU by access within a byte quota.

    <disk_dir>/<fingerprint digest hex>/<key as 32 hex digits>.kv

A folder holds one fingerprint's entries only; the tier never opens, lists or deletes any
other folder, so other models (or this model at another dtype, KV dtype or block size)
keep theirs. Files are written whole to a temporary name and renamed into place
(os.replace), so a reader sees an old file or a new one, never half of one; without fsync a
crash may still leave a short or zeroed file, which its checksum catches on read.

At start the folder is scanned reading each file's header only: a file of this fingerprint
with the expected length is an entry (least recently used first by mtime, which reads
refresh); a broken one is deleted and counted (corrupt_entries). A read checks the whole
record; a corrupt or truncated file is deleted, counted and reads as a miss.

Any OSError while writing (a full disk, no permission, a quota) logs one warning and turns
writing off for the life of the tier: reads keep working, nothing raises into a request.
Invariant: used == sum of the sizes of the indexed files <= capacity (all records of one
fingerprint have one size).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict

from pagoda.executor.kv_offload import record as rec

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 600
"""A temporary file older than this at start was left by a crash (never a writer's)."""


class DiskTier:
    def __init__(self, root: str, digest: bytes, capacity: int, payload_bytes: int,
                 stats: Counter) -> None:
        self.folder = os.path.join(root, digest.hex())
        self.digest = digest
        self.capacity = capacity
        self.payload_bytes = payload_bytes
        self.record_bytes = rec.HEADER_BYTES + payload_bytes
        self.stats = stats
        self.index: OrderedDict[int, int] = OrderedDict()  # key -> file size, LRU first
        self.used = 0
        self.writable = True
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as error:
            self._degrade(error)  # the folder is not there: nothing to scan either
        else:
            self._scan()

    # ---- paths and bookkeeping --------------------------------------------------------------

    def path(self, key: int) -> str:
        return os.path.join(self.folder, f"{key:032x}{SUFFIX}")

    def __contains__(self, key: int) -> bool:
        return key in self.index

    def keys(self) -> list[int]:
        """Entries, least recently used first."""
        return list(self.index)

    def _degrade(self, error: OSError) -> None:
        self.stats["disk_errors"] += 1
        if self.writable:
            self.writable = False
            logger.warning("KV offload disk tier %s: %s; no longer writing to it (reads go on)",
                           self.folder, error)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self.stats["disk_errors"] += 1
            logger.debug("KV offload: cannot delete %s: %s", path, error)

    def _forget(self, key: int) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used -= size

    # ---- start -----------------------------------------------------------------------------

    def _scan(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError as error:
            logger.warning("KV offload disk tier %s: cannot list it: %s", self.folder, error)
            return
        found = []
        now = time.time()
        for name in names:
            path = os.path.join(self.folder, name)
            if name.endswith(TMP_SUFFIX):
                try:
                    if now - os.stat(path).st_mtime > STALE_TMP_SECONDS:
                        self._unlink(path)
                except OSError:
                    pass
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    mtime = os.fstat(f.fileno()).st_mtime_ns
                    header = f.read(rec.HEADER_BYTES)
            except OSError:
                continue
            if rec.other_fingerprint(header, self.digest):
                continue
            key = rec.header_key(header, self.digest, self.payload_bytes)
            if key is None or name != f"{key:032x}{SUFFIX}" or size != self.record_bytes:
                self.stats["corrupt_entries"] += 1
                self._unlink(path)
                continue
            found.append((mtime, key, size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
        self._make_room(0)

    # ---- entries ---------------------------------------------------------------------------

    def read(self, key: int) -> bytes | None:
        """`key`'s whole record, checked (record.payload_of), now the most recently used;
        None if absent or broken (a broken file is deleted)."""
        if key not in self.index:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.record_bytes + 1)
        except OSError:
            self._forget(key)
            return None
        if rec.payload_of(data, key, self.digest, self.payload_bytes) is None:
            self.stats["corrupt_entries"] += 1
            self._forget(key)
            self._unlink(path)
            return None
        self.index.move_to_end(key)
        self.stats["disk_bytes_read"] += len(data)
        try:
            os.utime(path)  # the LRU order a restart reads back
        except OSError:
            pass
        return data

    def touch(self, key: int) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    def write(self, key: int, record: bytes) -> tuple[bool, list[int]]:
        """Store `record` as `key`'s file, evicting least recently used files to keep the
        quota. Returns (stored, evicted keys). Never raises: an OSError degrades the tier."""
        if not self.writable or len(record) > self.capacity:
            return False, []
        if key in self.index:
            self.index.move_to_end(key)
            return True, []
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
        try:
            _write_file(tmp, record)
        except OSError as error:
            self._unlink(tmp)
            self._degrade(error)
            return False, []
        evicted = self._make_room(len(record))
        try:
            os.replace(tmp, path)
        except OSError as error:
            self._unlink(tmp)
            self._degrade(error)
            return False, evicted
        self.index[key] = len(record)
        self.used += len(record)
        self.stats["disk_bytes_written"] += len(record)
        return True, evicted

    def delete(self, key: int) -> None:
        if key in self.index:
            self._forget(key)
            self._unlink(self.path(key))

    def _make_room(self, size: int) -> list[int]:
        """Evict LRU entries until `size` more bytes fit the quota; the evicted keys."""
        evicted = []
        while self.index and self.used + size > self.capacity:
            key = next(iter(self.index))
            self.delete(key)
            self.stats["disk_evictions"] += 1
            evicted.append(key)
        return evicted


def _write_file(path: str, data: bytes) -> None:
    """Write `data` as the new file `path` (module level: tests make it fail)."""
    with open(path, "wb") as f:
        f.write(data)

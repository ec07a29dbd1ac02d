"""The host-memory tier: records (record.py) in RAM, LRU by bytes within a capacity.

Two kinds of entry share the capacity:
  persistent  prefix blocks keyed by their hash chain; evicted first (LRU), and the worker
              demotes what is evicted to the disk tier;
  swap        a preempted request's blocks (persistent=False); evicted only when no
              persistent entry is left to evict, and then dropped (never written to disk).
Invariant: bytes[kind] == sum of len(record) over that kind's map; used == both <= capacity.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = {True: 0, False: 0}  # persistent -> bytes held
        self.persistent: OrderedDict[int, bytes] = OrderedDict()  # LRU first
        self.swap: OrderedDict[int, bytes] = OrderedDict()

    @property
    def used(self) -> int:
        return self.bytes[True] + self.bytes[False]

    def __contains__(self, key: int) -> bool:
        return key in self.persistent or key in self.swap

    def keys(self) -> list[int]:
        """Persistent keys, least recently used first."""
        return list(self.persistent)

    def get(self, key: int) -> tuple[bytes, bool] | None:
        """(record, persistent) of `key`, now the most recently used; None if absent."""
        for entries, persistent in ((self.persistent, True), (self.swap, False)):
            record = entries.get(key)
            if record is not None:
                entries.move_to_end(key)
                return record, persistent
        return None

    def touch(self, key: int) -> bool:
        """Mark `key` most recently used; whether it is here."""
        for entries in (self.persistent, self.swap):
            if key in entries:
                entries.move_to_end(key)
                return True
        return False

    def remove(self, key: int) -> bytes | None:
        for entries, kind in ((self.persistent, True), (self.swap, False)):
            record = entries.pop(key, None)
            if record is not None:
                self.bytes[kind] -= len(record)
                return record
        return None

    def put(self, key: int, record: bytes, persistent: bool
            ) -> tuple[bool, list[tuple[int, bytes, bool]]]:
        """Store `record` as the most recently used entry, evicting LRU entries to make room
        (a persistent record never evicts a swap entry). Returns (stored, evicted), evicted
        as (key, record, persistent), oldest first. Nothing is evicted when the record
        cannot be stored."""
        self.remove(key)
        size = len(record)
        evictable = self.bytes[True] + (0 if persistent else self.bytes[False])
        if size > self.capacity - self.used + evictable:
            return False, []
        evicted = []
        for entries, kind in ((self.persistent, True), (self.swap, False)):
            while self.capacity - self.used < size and entries:
                old_key, old = entries.popitem(last=False)
                self.bytes[kind] -= len(old)
                evicted.append((old_key, old, kind))
        (self.persistent if persistent else self.swap)[key] = record
        self.bytes[persistent] += size
        return True, evicted

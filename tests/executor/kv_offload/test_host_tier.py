"""The host-memory tier: LRU by bytes, evictions demoted to the disk tier (persistent entries
only), swap entries kept in RAM and evicted after persistent ones."""

from __future__ import annotations

import os

import torch

from tests.executor.kv_offload.caches import block_bytes, make_caches, worker


def disk_keys(w) -> set[int]:
    return {int(name[:-3], 16) for name in os.listdir(w.disk.folder) if name.endswith(".kv")}


def test_lru_evicts_the_least_recently_used_and_demotes_it_to_disk(tmp_path) -> None:
    caches = make_caches()
    originals = {b: block_bytes(caches, b) for b in range(4)}
    w = worker(caches, host_records=2, disk_dir=tmp_path, disk_records=8)
    w.save([(10, 0, True), (11, 1, True)])
    assert w.take_stats()["host_bytes_written"] == 2 * w.record_bytes
    assert w.load([(10, 5)]) == []           # 10 is now more recent than 11
    w.save([(12, 2, True)])                  # evicts 11, the least recently used
    assert set(w.host.persistent) == {10, 12}
    assert disk_keys(w) == {11}
    stats = w.take_stats()
    assert stats["host_evictions"] == 1
    assert stats["disk_bytes_written"] == w.record_bytes
    w.save([(13, 3, True)])                  # evicts 10
    assert list(w.host.persistent) == [12, 13]
    assert disk_keys(w) == {10, 11}
    assert w.take_dropped() == []            # nothing left every tier
    # A demoted entry reads back from disk, bit for bit, and is promoted to the host tier.
    assert w.load([(11, 6)]) == []
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, 6), originals[1]))
    stats = w.take_stats()
    assert (stats["host_misses"], stats["disk_hits"]) == (1, 1)
    assert list(w.host.persistent) == [13, 11]
    assert sorted(w.known_keys()) == [10, 11, 12, 13]


def test_without_a_disk_tier_evicted_keys_are_reported_dropped() -> None:
    w = worker(make_caches(), host_records=2.5)
    w.save([(1, 0, True), (2, 1, True), (3, 2, True)])
    assert list(w.host.persistent) == [2, 3]
    assert w.take_dropped() == [1]
    assert w.take_dropped() == []
    assert w.load([(1, 4), (2, 5)]) == [1]
    assert w.host.used <= w.host.capacity


def test_saving_a_held_key_again_only_refreshes_it() -> None:
    w = worker(make_caches(), host_records=2)
    w.save([(1, 0, True), (2, 1, True)])
    w.take_stats()
    w.save([(1, 0, True)])                    # same hash, same content: no copy
    assert w.take_stats()["host_bytes_written"] == 0
    w.save([(3, 2, True)])
    assert list(w.host.persistent) == [1, 3]


def test_swap_entries_never_reach_disk(tmp_path) -> None:
    caches = make_caches()
    w = worker(caches, host_records=2, disk_dir=tmp_path, disk_records=8)
    swapped = block_bytes(caches, 3)
    w.save([(100, 0, False), (1, 1, True), (2, 2, True)])  # 1 (persistent) goes first
    assert disk_keys(w) == {1}
    assert set(w.host.swap) == {100}
    w.save([(101, 3, False)])                 # evicts 2 (persistent) before swap 100
    assert disk_keys(w) == {1, 2}
    w.save([(102, 4, False)])                 # only swap entries left: 100 is dropped
    assert disk_keys(w) == {1, 2}
    assert set(w.host.swap) == {101, 102}
    assert w.take_dropped() == []             # dropped swap keys are not reported
    assert w.load([(100, 6), (101, 7)]) == [100]
    assert w.load([(101, 0)]) == []
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, 0), swapped))
    w.drop([101, 102])
    assert w.host.used == 0
    assert w.load([(101, 6)]) == [101]
    assert sorted(w.known_keys()) == [1, 2]


def test_a_persistent_save_never_evicts_swap_entries(tmp_path) -> None:
    """With the host tier full of swap entries, a persistent block goes straight to disk;
    without a disk tier it is reported dropped."""
    w = worker(make_caches(), host_records=2, disk_dir=tmp_path, disk_records=8)
    w.save([(100, 0, False), (101, 1, False), (1, 2, True)])
    assert set(w.host.swap) == {100, 101} and not w.host.persistent
    assert disk_keys(w) == {1}
    assert w.load([(1, 5)]) == []
    nodisk = worker(make_caches(), host_records=2)
    nodisk.save([(100, 0, False), (101, 1, False), (1, 2, True)])
    assert nodisk.take_dropped() == [1]
    assert nodisk.load([(100, 3), (101, 4)]) == []

"""The disk tier: survives a restart, is invisible to another fingerprint, drops corrupt or
truncated files, keeps serving under a tiny quota, and degrades (one warning, no error) when
writes fail."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from pagoda.executor.kv_offload import disk_tier
from tests.executor.kv_offload.caches import FINGERPRINT, block_bytes, make_caches, worker


def kv_files(folder) -> set[int]:
    return {int(name[:-3], 16) for name in os.listdir(folder) if name.endswith(".kv")}


def equal_blocks(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_entries_survive_a_restart_and_stay_invisible_to_another_fingerprint(tmp_path) -> None:
    caches = make_caches(seed=1)
    saved = {key: block_bytes(caches, block) for key, block in ((7, 0), (8, 1), (9, 2))}
    first = worker(caches, disk_dir=tmp_path, disk_records=8)
    first.save([(7, 0, True), (8, 1, True), (9, 2, True)])
    assert kv_files(first.disk.folder) == {7, 8, 9}
    del first

    # Another model (fingerprint string) and another layout (bfloat16) see nothing, load
    # nothing, and delete nothing; their own entries go in their own folders.
    for other in (worker(make_caches(), disk_dir=tmp_path, disk_records=8,
                         fingerprint=FINGERPRINT.replace("123", "124")),
                  worker(make_caches(torch.bfloat16), disk_dir=tmp_path, disk_records=8)):
        assert other.known_keys() == []
        assert other.load([(7, 3), (8, 4)]) == [7, 8]
        other.save([(50, 5, True)])
        assert kv_files(other.disk.folder) == {50}

    # The same model after a restart (fresh caches) finds and reads every entry.
    restarted_caches = make_caches(seed=2)
    restarted = worker(restarted_caches, disk_dir=tmp_path, disk_records=8)
    assert sorted(restarted.known_keys()) == [7, 8, 9]
    assert restarted.load([(9, 5), (7, 6)]) == []
    assert equal_blocks(block_bytes(restarted_caches, 5), saved[9])
    assert equal_blocks(block_bytes(restarted_caches, 6), saved[7])
    stats = restarted.take_stats()
    assert stats["disk_hits"] == 2
    assert stats["disk_bytes_read"] == 2 * restarted.record_bytes
    assert len(os.listdir(tmp_path)) == 3  # one folder a fingerprint


def test_flipped_byte_and_truncated_file_fail_are_counted_and_removed(tmp_path) -> None:
    caches = make_caches(seed=3)
    w = worker(caches, disk_dir=tmp_path, disk_records=8)
    w.save([(1, 0, True), (2, 1, True), (3, 2, True)])
    flipped, truncated = w.disk.path(1), w.disk.path(2)
    with open(flipped, "r+b") as f:
        f.seek(w.record_bytes // 2)
        byte = f.read(1)
        f.seek(w.record_bytes // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with open(truncated, "r+b") as f:
        f.truncate(w.record_bytes - 7)
    before = {block: block_bytes(caches, block) for block in (4, 5)}
    assert w.load([(1, 4), (2, 5), (3, 6)]) == [1, 2]
    for block in (4, 5):   # failed loads leave their blocks alone
        assert equal_blocks(block_bytes(caches, block), before[block])
    stats = w.take_stats()
    assert stats["corrupt_entries"] == 2
    assert (stats["disk_hits"], stats["disk_misses"]) == (1, 2)
    assert not os.path.exists(flipped) and not os.path.exists(truncated)
    assert sorted(w.take_dropped()) == [1, 2]
    assert w.known_keys() == [3]


def test_a_broken_file_is_dropped_at_start_reading_only_headers(tmp_path) -> None:
    w = worker(make_caches(), disk_dir=tmp_path, disk_records=8)
    w.save([(1, 0, True), (2, 1, True), (3, 2, True)])
    with open(w.disk.path(1), "r+b") as f:   # a flipped header byte (the magic)
        f.write(b"X")
    with open(w.disk.path(2), "r+b") as f:   # truncated
        f.truncate(100)
    os.rename(w.disk.path(3), w.disk.path(4))  # filed under another key
    restarted = worker(make_caches(), disk_dir=tmp_path, disk_records=8)
    assert restarted.known_keys() == []
    assert restarted.take_stats()["corrupt_entries"] == 3
    assert os.listdir(restarted.disk.folder) == []


def test_a_tiny_quota_keeps_serving_with_evictions(tmp_path) -> None:
    caches = make_caches(seed=4)
    w = worker(caches, disk_dir=tmp_path, disk_records=1.5)  # less than two entries
    for key in range(1, 6):
        w.save([(key, key, True)])
        assert kv_files(w.disk.folder) == {key}
        assert w.disk.used <= w.disk.capacity
        assert w.load([(key, 0)]) == []
        assert equal_blocks(block_bytes(caches, 0), block_bytes(caches, key))
    assert w.load([(1, 0), (4, 0)]) == [1, 4]
    stats = w.take_stats()
    assert stats["disk_evictions"] == 4
    assert stats["disk_errors"] == 0
    assert sorted(w.take_dropped()) == [1, 2, 3, 4]


def test_start_orders_entries_by_mtime_for_lru(tmp_path) -> None:
    w = worker(make_caches(), disk_dir=tmp_path, disk_records=3)
    w.save([(1, 0, True), (2, 1, True), (3, 2, True)])
    for age, key in ((300, 2), (200, 3), (100, 1)):  # 2 is the oldest, 1 the newest
        stamp = 1_700_000_000 - age
        os.utime(w.disk.path(key), (stamp, stamp))
    restarted = worker(make_caches(), disk_dir=tmp_path, disk_records=3)
    assert restarted.known_keys() == [2, 3, 1]
    restarted.save([(4, 3, True)])
    assert kv_files(restarted.disk.folder) == {3, 1, 4}
    assert restarted.take_dropped() == [2]


def test_a_failing_disk_degrades_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    caches = make_caches(seed=5)
    w = worker(caches, host_records=1, disk_dir=tmp_path, disk_records=8)
    w.save([(1, 0, True), (2, 1, True)])      # 1 demoted to disk while it works
    assert kv_files(w.disk.folder) == {1}

    def full(path, data):
        with open(path, "wb") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "_write_file", full)
    with caplog.at_level(logging.WARNING, logger="pagoda.executor.kv_offload"):
        w.save([(3, 2, True), (4, 3, True), (5, 4, True)])  # every eviction fails to write
        w.flush([(6, 5)])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert w.take_stats()["disk_errors"] == 1
    assert w.usage()["disk_writable"] == 0
    assert sorted(w.take_dropped()) == [2, 3, 4]
    assert not [n for n in os.listdir(w.disk.folder) if not n.endswith(".kv")]  # no tmp left
    # Reads go on: the host entry and the entry written before the failure.
    assert w.load([(5, 6), (1, 7), (2, 6)]) == [2]
    assert equal_blocks(block_bytes(caches, 7), block_bytes(caches, 0))


def test_an_unusable_dir_degrades_without_raising(tmp_path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pagoda.executor.kv_offload"):
        w = worker(make_caches(), host_records=1, disk_dir=blocker, disk_records=8)
        w.save([(1, 0, True), (2, 1, True)])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert w.take_dropped() == [1]
    assert w.load([(2, 3)]) == []


def test_flush_writes_pool_blocks_first_within_the_quota(tmp_path) -> None:
    caches = make_caches(seed=6)
    w = worker(caches, host_records=4, disk_dir=tmp_path, disk_records=3)
    w.save([(1, 0, True), (2, 1, True), (3, 2, True)])
    assert kv_files(w.disk.folder) == set()   # all in the host tier
    w.flush([(10, 4), (11, 5)])               # quota 3: both pool blocks, then host's newest
    assert kv_files(w.disk.folder) == {10, 11, 3}
    restarted_caches = make_caches(seed=7)
    restarted = worker(restarted_caches, disk_dir=tmp_path, disk_records=3)
    assert sorted(restarted.known_keys()) == [3, 10, 11]
    assert restarted.load([(10, 0), (3, 1)]) == []
    assert equal_blocks(block_bytes(restarted_caches, 0), block_bytes(caches, 4))
    assert equal_blocks(block_bytes(restarted_caches, 1), block_bytes(caches, 2))


def test_drop_forgets_a_key_in_every_tier(tmp_path) -> None:
    w = worker(make_caches(), host_records=1, disk_dir=tmp_path, disk_records=8)
    w.save([(1, 0, True), (2, 1, True)])
    w.load([(1, 3)])                          # on disk, promoted to the host tier too
    w.drop([1, 2])
    assert w.known_keys() == []
    assert kv_files(w.disk.folder) == set()
    assert w.load([(1, 3), (2, 4)]) == [1, 2]


def test_config_errors_name_the_problem() -> None:
    from pagoda.executor.kv_offload import KVOffloadConfig
    with pytest.raises(ValueError, match="host_bytes"):
        KVOffloadConfig(-1)
    with pytest.raises(ValueError, match="disk_bytes"):
        KVOffloadConfig(0, "/tmp/x", 0)

"""A pool block survives the trip through a record (record.py + block_copy.py) bit for bit,
for the float caches and the 8-bit one; a record that is not exactly what the reader asks
for never yields a payload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.executor.kv_offload import record as rec
from tests.executor.kv_offload.caches import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    block_bytes,
    make_caches,
    planes,
    same_block,
    worker,
)

KINDS = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8"),
         (torch.float32, "fp8_e5m2")]


def test_payload_holds_every_layers_k_and_v_rows_and_scales() -> None:
    element = {torch.float32: 4, torch.bfloat16: 2}
    for dtype, kv_cache_dtype in KINDS:
        w = worker(make_caches(dtype, kv_cache_dtype), host_records=4)
        row = HEAD_DIM + 2 if kv_cache_dtype != "auto" else HEAD_DIM * element[dtype]
        assert w.payload_bytes == NUM_LAYERS * 2 * NUM_KV_HEADS * BLOCK_SIZE * row


@pytest.mark.parametrize("dtype,kv_cache_dtype", KINDS)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_round_trip_is_bit_exact(dtype, kv_cache_dtype, tier, tmp_path) -> None:
    source = make_caches(dtype, kv_cache_dtype, seed=1)
    original = [block_bytes(source, b) for b in range(NUM_BLOCKS)]
    w = (worker(source, host_records=NUM_BLOCKS) if tier == "host"
         else worker(source, disk_dir=tmp_path, disk_records=NUM_BLOCKS))
    w.save([(1000 + b, b, True) for b in (5, 0, 3)])
    # The pool's blocks get new content (other requests), then the keys come back into
    # other block ids.
    for plane, other in zip(planes(source), planes(make_caches(dtype, kv_cache_dtype, seed=2))):
        plane.copy_(other)
    target = source
    untouched = [block_bytes(target, b) for b in range(NUM_BLOCKS)]
    assert w.load([(1005, 1), (1000, 7), (1003, 2), (77, 4)]) == [77]
    for source_block, target_block in ((5, 1), (0, 7), (3, 2)):
        assert all(torch.equal(a, b) for a, b in zip(block_bytes(target, target_block),
                                                     original[source_block]))
    for b in (0, 3, 4, 5, 6):  # the failed key's block and blocks not named stay as they were
        assert all(torch.equal(a, c) for a, c in zip(block_bytes(target, b), untouched[b]))
    stats = w.take_stats()
    assert stats[f"{tier}_hits"] == 3
    assert stats[f"{tier}_bytes_read"] == 3 * w.record_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_keys_only_cache_round_trips_its_one_plane(kv_cache_dtype, tmp_path) -> None:
    """Latent attention's cache (values are the keys: one plane): the payload is half a
    two-plane one's, and blocks come back bit for bit through the disk tier."""
    source = make_caches(torch.float32, kv_cache_dtype, seed=1, kv_planes=1)
    w = worker(source, disk_dir=tmp_path, disk_records=NUM_BLOCKS)
    two_planes = worker(make_caches(torch.float32, kv_cache_dtype), host_records=1)
    assert w.payload_bytes * 2 == two_planes.payload_bytes
    original = block_bytes(source, 5)
    w.save([(1000, 5, True)])
    for plane, other in zip(planes(source), planes(make_caches(
            torch.float32, kv_cache_dtype, seed=2, kv_planes=1))):
        plane.copy_(other)
    assert w.load([(1000, 2)]) == []
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(source, 2), original))


def test_save_copies_before_the_block_is_overwritten() -> None:
    caches = make_caches(seed=3)
    before = block_bytes(caches, 2)
    w = worker(caches, host_records=2)
    w.save([(5, 2, True)])
    caches[0][:, :, 2].fill_(1.0)  # the step's forward reuses the block
    assert w.load([(5, 2)]) == []
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, 2), before))
    assert not same_block(caches, 2, caches, 3)


def _record(key: int = 42, digest: bytes = b"d" * 16, payload: bytes = bytes(range(200))) -> bytes:
    buffer = bytearray(rec.HEADER_BYTES + len(payload))
    buffer[rec.HEADER_BYTES:] = payload
    array = np.frombuffer(buffer, dtype=np.uint8)
    rec.write_header(array, key, digest)
    return bytes(buffer)


def test_record_checks_every_field() -> None:
    digest, payload = b"d" * 16, bytes(range(200))
    good = _record(42, digest, payload)
    assert bytes(rec.payload_of(good, 42, digest, 200)) == payload
    assert rec.header_key(good[:rec.HEADER_BYTES], digest, 200) == 42
    assert rec.payload_of(good[:-1], 42, digest, 200) is None           # truncated
    assert rec.payload_of(good + b"\0", 42, digest, 200) is None        # too long
    assert rec.payload_of(good, 43, digest, 200) is None                # other key
    assert rec.payload_of(good, 42, b"e" * 16, 200) is None             # other fingerprint
    assert rec.payload_of(good, 42, digest, 199) is None                # other layout size
    for at in (0, 4, 8, 24, 40, 48, rec.HEADER_BYTES, len(good) - 1):   # any flipped byte
        flipped = bytearray(good)
        flipped[at] ^= 0x10
        assert rec.payload_of(bytes(flipped), 42, digest, 200) is None, at
    assert rec.other_fingerprint(_record(digest=b"e" * 16), digest)
    assert not rec.other_fingerprint(good, digest)
    with pytest.raises(ValueError, match="128-bit"):
        rec.key_bytes(-1)
    with pytest.raises(ValueError, match="128-bit"):
        rec.key_bytes(1 << 128)


def test_layout_is_part_of_the_fingerprint() -> None:
    """Same fingerprint string, another dtype, KV dtype or block size: another digest."""
    digests = {worker(make_caches(dtype, kv, block_size=bs)).digest
               for dtype, kv in KINDS for bs in (4, 8)}
    assert len(digests) == len(KINDS) * 2


def test_bad_block_id_is_a_clear_error() -> None:
    w = worker(make_caches(), host_records=2)
    with pytest.raises(IndexError, match="outside the pool"):
        w.save([(1, NUM_BLOCKS, True)])


def test_narrow_rows_copy_in_narrower_words() -> None:
    """Block size 1 with the 8-bit cache: a scale row is 2 bytes, so copies move int16 words;
    the round trip stays bit for bit."""
    caches = make_caches(torch.float32, "int8", seed=4, block_size=1)
    w = worker(caches, host_records=NUM_BLOCKS)
    assert w.copier.unit == 2
    assert worker(make_caches(torch.float32, "int8")).copier.unit == 8
    saved = block_bytes(caches, 6)
    w.save([(9, 6, True)])
    assert w.load([(9, 1)]) == []
    assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, 1), saved))

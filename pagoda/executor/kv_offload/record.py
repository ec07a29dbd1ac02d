"""One offloaded KV block as bytes: a fixed header, then the block's payload (block_copy.py).

    offset  size  field
         0     4  magic b"PGKV"
         4     2  format version (little-endian; FORMAT_VERSION)
         6     2  reserved (0)
         8    16  fingerprint digest (fingerprint_digest: model, dtypes, block size, layout)
        24    16  key (the block's 128-bit chained hash, or a swap key), little-endian
        40     8  payload length in bytes
        48     8  xxh3_64 of the payload
        56     8  reserved (0)
        64     -  payload

The same bytes sit in the host tier and in a disk file. A record is only ever used after
`payload_of` has checked every field against what the reader expects, so a truncated file,
a flipped bit, another model's entry or an entry filed under the wrong name reads as a miss.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

MAGIC = b"PGKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH16s16sQQ8x")
HEADER_BYTES = HEADER.size  # 64: payloads start 64-byte aligned within a record buffer
KEY_BYTES = 16


def fingerprint_digest(fingerprint: str) -> bytes:
    """The 16 bytes a record carries for `fingerprint` (its hex names the disk folder)."""
    return xxhash.xxh3_128_digest(fingerprint.encode("utf-8"))


def key_bytes(key: int) -> bytes:
    if not 0 <= key < 1 << 128:
        raise ValueError(f"KV offload key {key!r} is not a 128-bit unsigned integer")
    return key.to_bytes(KEY_BYTES, "little")


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(record: np.ndarray, key: int, digest: bytes) -> None:
    """Fill the header of `record` (uint8, HEADER_BYTES + payload) whose payload is in place."""
    payload = record[HEADER_BYTES:]
    HEADER.pack_into(record, 0, MAGIC, FORMAT_VERSION, 0, digest, key_bytes(key),
                     payload.nbytes, checksum(payload))


def header_key(header: bytes, digest: bytes, payload_bytes: int) -> int | None:
    """The key of a record whose first HEADER_BYTES are `header`, if the header is this
    format's, of fingerprint `digest`, with a payload of `payload_bytes`; else None. Reads
    nothing of the payload (the disk tier's startup scan)."""
    if len(header) < HEADER_BYTES:
        return None
    magic, version, _, got_digest, key, length, _ = HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION or got_digest != digest:
        return None
    if length != payload_bytes:
        return None
    return int.from_bytes(key, "little")


def payload_of(record: bytes, key: int, digest: bytes, payload_bytes: int) -> memoryview | None:
    """The payload of `record` if it is whole and is `key`'s entry of fingerprint `digest`
    (header fields, length and checksum all match); else None."""
    if len(record) != HEADER_BYTES + payload_bytes:
        return None
    if header_key(record, digest, payload_bytes) != key:
        return None
    payload = memoryview(record)[HEADER_BYTES:]
    if checksum(payload) != HEADER.unpack_from(record)[6]:
        return None
    return payload


def other_fingerprint(header: bytes, digest: bytes) -> bool:
    """Whether `header` is a whole header of this format naming a fingerprint other than
    `digest`: such a file is another model's entry, never deleted (a broken file of this
    fingerprint is)."""
    if len(header) < HEADER_BYTES:
        return False
    magic, version, _, got_digest, *_ = HEADER.unpack_from(header)
    return magic == MAGIC and version == FORMAT_VERSION and got_digest != digest

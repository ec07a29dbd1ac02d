"""A GGUF file's header in pure Python: its metadata and the name, shape, type and offset of
each tensor, without reading (or mapping) the tensors, nor importing numpy or the `gguf`
package, so that the service layer can vet an adapter file cheaply.

Layout (GGUF v2/v3, little-endian): b"GGUF", uint32 version, uint64 tensor count, uint64
metadata count; each metadata entry: string key, uint32 value type, value; each tensor:
string name, uint32 n_dims, uint64 dims (fastest-varying first), uint32 ggml type, uint64
offset (from the aligned start of the data section). A string is uint64 length + UTF-8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata value type -> struct format (8 string, 9 array are read apart)."""
_STRING, _ARRAY = 8, 9
GGML_TYPE_SIZES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2)}
"""ggml type id -> (name, elements per block, bytes per block): the types
convert_lora_to_gguf.py writes (--outtype f32, f16, bf16, q8_0)."""
MAX_COUNT = 1 << 24
"""Bounds the counts a damaged header could claim."""


class GGUFHeaderError(ValueError):
    """Not a GGUF file, a truncated or damaged header, or a tensor type not read here."""


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    """Slowest-varying first (torch's order): a (rows, cols) matrix is (rows, cols)."""
    type_name: str
    n_bytes: int
    offset: int
    """From the start of the file."""


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    """Metadata key -> value (strings, numbers, bools; arrays as lists)."""
    tensors: list[GGUFTensorInfo]


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise GGUFHeaderError("truncated GGUF header")
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        try:
            return self.take(self.unpack("<Q")).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError("damaged GGUF header (a string is not UTF-8)") from None

    def count(self) -> int:
        value = self.unpack("<Q")
        if value > MAX_COUNT:
            raise GGUFHeaderError(f"damaged GGUF header (a count of {value})")
        return value

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.unpack("<I")
            return [self.value(item_type) for _ in range(self.count())]
        raise GGUFHeaderError(f"damaged GGUF header (value type {value_type})")


def read_gguf_header(path: str) -> GGUFHeader:
    """The header of the GGUF file at `path` (OSError where it cannot be opened)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        reader = _Reader(f, f.tell())
        f.seek(0)
        if reader.take(4) != GGUF_MAGIC:
            raise GGUFHeaderError("not a GGUF file")
        version = reader.unpack("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, field_count = reader.count(), reader.count()
        fields = {}
        for _ in range(field_count):
            key = reader.string()
            fields[key] = reader.value(reader.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = reader.string()
            n_dims = reader.unpack("<I")
            if n_dims > 4:
                raise GGUFHeaderError(f"damaged GGUF header (tensor {name!r}: {n_dims} dims)")
            dims = [reader.unpack("<Q") for _ in range(n_dims)]
            type_id, offset = reader.unpack("<I"), reader.unpack("<Q")
            infos.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = fields.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise GGUFHeaderError(f"damaged GGUF header (general.alignment {alignment!r})")
        data_start = -(-f.tell() // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in infos:
        if type_id not in GGML_TYPE_SIZES:
            raise GGUFHeaderError(
                f"tensor {name!r} has ggml type {type_id}; supported: "
                f"{', '.join(t[0] for t in GGML_TYPE_SIZES.values())}")
        type_name, block, block_bytes = GGML_TYPE_SIZES[type_id]
        elements = 1
        for dim in shape:
            elements *= dim
        if shape and shape[-1] % block:
            raise GGUFHeaderError(f"tensor {name!r}: rows of {shape[-1]} are not whole "
                                  f"{type_name} blocks")
        n_bytes = elements // block * block_bytes
        if data_start + offset + n_bytes > reader.size:
            raise GGUFHeaderError(f"truncated GGUF file (tensor {name!r} ends past its end)")
        tensors.append(GGUFTensorInfo(name, shape, type_name, n_bytes, data_start + offset))
    return GGUFHeader(version, fields, tensors)

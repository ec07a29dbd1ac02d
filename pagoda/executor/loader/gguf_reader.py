"""The `gguf` package's GGUFReader without its per-entry objects for long metadata arrays.

GGUFReader turns every entry of an array field into its own numpy view (a string into two):
the tokenizer's arrays of a 49K vocabulary (tokens, scores, types, merges) become ~250K
small objects, ~120 MB held while the file is open and ~60 MB of fragmented heap after.
Pagoda reads the tokenizer separately (loader/tokenizer.py), so here an array longer than
COMPACT_ARRAY_LENGTH is kept as one view (numbers) or skipped (strings: only its length
stays). `array_length` reads an array's length from its header in either form.
"""

from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFReader, GGUFValueType

COMPACT_ARRAY_LENGTH = 1024


class CompactGGUFReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        length, item_type = int(alen[0]), GGUFValueType(raw_itype[0])
        if length <= COMPACT_ARRAY_LENGTH or item_type == GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        types = [GGUFValueType.ARRAY, item_type]
        if item_type == GGUFValueType.STRING:  # (uint64 length, bytes) each: walk, keep none
            order = "<" if self.byte_order == "I" else ">"
            for _ in range(length):
                offs += 8 + struct.unpack_from(f"{order}Q", self.data, offs)[0]
            return offs - orig_offs, [raw_itype, alen], [], types
        values = self._get(offs, self.gguf_scalar_to_np[item_type], length)
        return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types


ARRAY_LENGTH_PART = 4
"""An array field's parts, as GGUFReader._build_fields lays them out: [key length, key bytes,
value type (ARRAY), item type, array length, items...] (the item parts absent for a compacted
array of strings); so the length is part 4, whether compacted or not."""


def array_length(reader: GGUFReader, key: str) -> int | None:
    """The number of entries of array field `key` (compacted or not), None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types[:1] != [GGUFValueType.ARRAY]:
        raise ValueError(f"GGUF field {key!r} is not an array")
    return int(field.parts[ARRAY_LENGTH_PART][0])

"""Hand the process heap's free pages back to the system."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): small freed
    allocations (float weights freed by quantization, packing's temporaries, timed
    products' operands) stay in the heap otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass

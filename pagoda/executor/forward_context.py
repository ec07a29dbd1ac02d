"""Per-step attention metadata, visible to attention layers only for the duration of a forward.

The model runner builds the step's attention metadata, a list with one AttentionMetadata
per KV-cache group (one unless the model has sliding-window layers), and runs the forward
inside `with forward_context(metadata):`. Attention layers read it with
`get_forward_context()` and take their group's by index.
A ContextVar (not a module global) holds it, and it is reset when the block exits, so no
step's metadata outlives that step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_current: ContextVar[Any] = ContextVar("pagoda_forward_context", default=None)


@contextlib.contextmanager
def forward_context(metadata: Any) -> Iterator[None]:
    token = _current.set(metadata)
    try:
        yield
    finally:
        _current.reset(token)


def get_forward_context() -> Any:
    metadata = _current.get()
    if metadata is None:
        raise RuntimeError("attention called outside `with forward_context(...)`")
    return metadata

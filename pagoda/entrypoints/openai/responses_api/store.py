"""The in-memory store of responses made with `store: true` (one per server, shared by its
models): GET and DELETE /v1/responses/{id}, its input items, and `previous_response_id`.

Bounded twice: at most `max_entries` responses (the oldest go first) and each for `ttl_s`
seconds after it was stored (--responses-store-size, --responses-store-ttl). Entries are kept
in the order they were stored, which with one TTL is also the order they expire in, so both
evictions pop from the front. `max_entries` 0 stores nothing. Nothing survives a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.entrypoints.openai.responses_api.objects import Response

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: Response
    """As it was answered (status completed, incomplete or failed)."""
    conversation: list
    """The input items a follow-up continues (protocol.InputItem models): the previous
    responses' conversation, this request's input, then this response's output."""
    input_items: list[dict]
    """This request's own input items as GET .../input_items lists them (each with an id)."""
    expires_at: float = 0.0


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_STORE_SIZE,
                 ttl_s: float = DEFAULT_STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"--responses-store-ttl must be > 0 seconds, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self.evict_expired()
        stored.expires_at = self.clock() + self.ttl_s
        self.entries[stored.response.id] = stored
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self.evict_expired()
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self.evict_expired()
        return self.entries.pop(response_id, None) is not None

    def evict_expired(self) -> None:
        now = self.clock()
        while self.entries:
            oldest = next(iter(self.entries.values()))
            if oldest.expires_at > now:
                return
            self.entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self.entries)

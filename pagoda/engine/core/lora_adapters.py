"""The LoRA adapters one engine knows, as the scheduler counts them. Pure Python: no torch.

An adapter is known by its `lora_int_id` (pagoda/lora/request.py) from the first request
that names it, or from `add(lora_request)` (vLLM's LLMEngine.add_lora), until it is removed:

    known ──remove(id)──> removing ──(no sequence of it left in the scheduler)──> gone
                          new requests refused          the next SchedulerOutput carries the
                          (InvalidRequestError)         id once in removed_lora_ids: the
                                                        runner frees its weights

Invariants:
- `num_sequences[id]` = sequences of that adapter the scheduler holds (waiting or running);
  the scheduler calls `hold` when it queues one and `release` when it frees one.
- An id in `removing` is in `known`; it leaves both in the same `take_removed` call that
  hands it to the runner, after which the id may be used again (its weights load anew).
- At most `max_loras` distinct adapters among the running sequences (the scheduler's
  admission rule, `fits`); base-model sequences (id 0) do not count.
"""

from __future__ import annotations

from collections import Counter

from pagoda.engine.core.request import Request
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest

LORA_OFF_MESSAGE = ("LoRA adapters are not enabled on this engine; start it with "
                    "--enable-lora (offline: LLM(..., enable_lora=True))")


class LoRAAdapters:
    def __init__(self, enabled: bool, max_loras: int) -> None:
        """`enabled`: --enable-lora (off, every request naming an adapter is refused);
        `max_loras`: most distinct adapters running at once."""
        self.enabled = enabled
        self.max_loras = max_loras
        self.known: dict[int, LoRARequest] = {}
        self.removing: set[int] = set()
        self.num_sequences: Counter[int] = Counter()

    # ---- engine commands ---------------------------------------------------------------------

    def check(self, lora_request: LoRARequest | None) -> None:
        """Raise InvalidRequestError unless a request may run with `lora_request`: LoRA on,
        the adapter not being removed, its id not another adapter's. Registers it."""
        if lora_request is None:
            return
        if not self.enabled:
            raise InvalidRequestError(LORA_OFF_MESSAGE, "lora_request")
        lora_id = lora_request.lora_int_id
        if lora_id in self.removing:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r} (lora_int_id {lora_id}) is being "
                "removed; it takes no new requests", "lora_request")
        known = self.known.get(lora_id)
        if known is not None and (known.lora_name, known.lora_path) != (
                lora_request.lora_name, lora_request.lora_path):
            raise InvalidRequestError(
                f"lora_int_id {lora_id} is already adapter {known.lora_name!r} "
                f"({known.lora_path}), not {lora_request.lora_name!r} "
                f"({lora_request.lora_path}); give each adapter its own id", "lora_request")
        self.known[lora_id] = known or lora_request

    def add(self, lora_request: LoRARequest) -> bool:
        """Know an adapter ahead of its requests (vLLM's add_lora); False if it was known
        already. Raises InvalidRequestError as `check` does."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        is_new = lora_request.lora_int_id not in self.known
        self.check(lora_request)
        return is_new

    def remove(self, lora_int_id: int) -> bool:
        """Mark an adapter for removal (vLLM's remove_lora): its requests in flight finish,
        new ones are refused, and once none is left the runner is told to free it. False
        for an id the engine does not know (or already removing)."""
        if not self.enabled:
            raise InvalidRequestError(LORA_OFF_MESSAGE, "lora_int_id")
        if lora_int_id not in self.known or lora_int_id in self.removing:
            return False
        self.removing.add(lora_int_id)
        return True

    def list(self) -> set[int]:
        """The ids of the adapters known and not being removed (vLLM's list_loras)."""
        return set(self.known) - self.removing

    # ---- the scheduler -----------------------------------------------------------------------

    def hold(self, request: Request) -> None:
        if request.lora_int_id:
            self.num_sequences[request.lora_int_id] += 1

    def release(self, request: Request) -> None:
        lora_id = request.lora_int_id
        if lora_id:
            self.num_sequences[lora_id] -= 1
            if self.num_sequences[lora_id] <= 0:
                del self.num_sequences[lora_id]

    def fits(self, active: set[int], lora_int_id: int) -> bool:
        """Whether a sequence of `lora_int_id` may join running sequences whose adapters
        are `active` without more than max_loras distinct adapters running."""
        return not lora_int_id or lora_int_id in active or len(active) < self.max_loras

    @property
    def has_pending_removal(self) -> bool:
        """An adapter removed whose last sequence has gone, not yet told to the runner."""
        return any(lora_id not in self.num_sequences for lora_id in self.removing)

    def take_removed(self) -> list[int]:
        """The adapters being removed whose sequences have all gone: forgotten here, to be
        freed by the runner (sorted, each returned once)."""
        gone = sorted(i for i in self.removing if i not in self.num_sequences)
        for lora_id in gone:
            self.removing.discard(lora_id)
            del self.known[lora_id]
        return gone

    def names(self, requests) -> tuple[str, ...]:
        """The adapter names of `requests` (Requests), each once, in order of first use."""
        return tuple(dict.fromkeys(
            r.lora_request.lora_name for r in requests if r.lora_request is not None))

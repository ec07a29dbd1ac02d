"""Which rows (tokens) of a step run which adapter, visible to the hooks (model_lora.py) and
the whole-stack decode (whole_stack_decode.py) only for the duration of that step's forward.

The runner builds one LoRAStep per step with adapter rows (manager.py) and runs the forward
inside `with lora_step(step):`; a step without adapter rows runs with None there, and every
hook then returns after one ContextVar lookup. A ContextVar (as forward_context.py), reset
when the block exits: no step's mapping outlives it, and a forward run outside any step
(a scratch one: prompt_logits, profiling, compile warm-up) runs the base model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAStep:
    row_slots: np.ndarray
    """(num_tokens,) int32: each row's slot in ModelLoRA.slots, -1 for base rows."""
    groups: list[tuple[int, slice | torch.Tensor]]
    """Per adapter with rows this step: (lora_int_id, its rows): a slice where they are
    contiguous, else an int64 index tensor. Rows of different groups never overlap."""

    @classmethod
    def from_rows(cls, row_slots: np.ndarray, slot_ids: list[int | None]) -> LoRAStep | None:
        """The step of `row_slots` (slot per row, -1 none) over ModelLoRA.slots `slot_ids`;
        None where no row runs an adapter."""
        row_slots = np.ascontiguousarray(row_slots, dtype=np.int32)
        groups = []
        for slot in np.unique(row_slots[row_slots >= 0]).tolist():
            rows = np.flatnonzero(row_slots == slot)
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == len(rows):
                groups.append((slot_ids[slot], slice(first, last + 1)))
            else:
                groups.append((slot_ids[slot], torch.from_numpy(rows.astype(np.int64))))
        return cls(row_slots, groups) if groups else None


_current: ContextVar[LoRAStep | None] = ContextVar("pagoda_lora_step", default=None)


@contextlib.contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)


def current_lora_step() -> LoRAStep | None:
    """The running step's mapping; None: no row of it runs an adapter (or no step runs)."""
    return _current.get()

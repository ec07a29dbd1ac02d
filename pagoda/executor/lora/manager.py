"""The runner's side of LoRA serving: which adapters are loaded (at most
LoRAConfig.max_loaded, least recently used dropped first, never one a running request
uses), which of ModelLoRA's max_loras slots each of a step's adapters takes, and the step's
row mapping (step.py).

An adapter is loaded on first use, from its LoRARequest's path (pagoda/lora/adapter_files.py
reads and checks it against the base, adapter_weights.py loads its pairs); one that cannot
be loaded fails its requests alone (ModelRunnerOutput.failed), the step goes on. Every
tensor-parallel rank runs the same manager on the same steps, so all load, slot and evict
alike. `SchedulerOutput.removed_lora_ids` (adapters unloaded by the engine, none of whose
requests remain) frees them here.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from pagoda.config import LoRAConfig
from pagoda.executor.lora.adapter_weights import load_lora_weights
from pagoda.executor.lora.model_lora import ModelLoRA
from pagoda.executor.lora.step import LoRAStep
from pagoda.lora.adapter_files import read_adapter
from pagoda.lora.adapter_fit import check_adapter
from pagoda.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def load_adapter_pairs(request: LoRARequest, hf_config, max_lora_rank: int,
                       lora_dtype: str = "auto") -> dict:
    """{(layer, target): LoRAPair} of the adapter at request.lora_path, checked against the
    base model's HF config, in `lora_dtype` (LoRAConfig's: auto keeps the file's);
    LoRAAdapterError (a ValueError) naming what is wrong."""
    adapter = read_adapter(request.lora_path)
    check_adapter(adapter, hf_config, max_lora_rank)
    return load_lora_weights(adapter, lora_dtype, base_config=hf_config)


class LoRAManager:
    def __init__(self, model_lora: ModelLoRA, config: LoRAConfig, hf_config,
                 load: Callable[[LoRARequest, object, int], dict] | None = None) -> None:
        """`load` (request, hf_config, max_lora_rank) -> pairs; default load_adapter_pairs in
        config.lora_dtype."""
        self.model_lora = model_lora
        self.max_loaded = config.max_loaded
        self.max_lora_rank = config.max_lora_rank
        self.hf_config = hf_config
        self._load = load or functools.partial(load_adapter_pairs,
                                               lora_dtype=config.lora_dtype)
        self.lru: OrderedDict[int, LoRARequest] = OrderedDict()
        """Loaded adapters, least recently used first."""

    def step(self, lora_requests: Sequence[LoRARequest | None], request_ids: Sequence[str],
             num_scheduled: np.ndarray, in_use: set[int]) -> tuple[LoRAStep | None,
                                                                   dict[str, str]]:
        """The step's mapping for requests (batch order) running `lora_requests` (None: the
        base) over `num_scheduled` tokens each, loading and slotting their adapters;
        `in_use`: the adapters of every request the runner holds (not dropped when making
        room). Returns (the mapping, None when no row runs an adapter; request id -> why
        its adapter could not be loaded: those rows run the base and the request fails)."""
        failed: dict[str, str] = {}
        ids = [0 if r is None else r.lora_int_id for r in lora_requests]
        if not any(ids):
            return None, failed
        errors: dict[int, str] = {}  # (an adapter that failed is tried once a step)
        for request, request_id in zip(lora_requests, request_ids):
            if request is None:
                continue
            if request.lora_int_id not in errors:
                error = self._ensure_loaded(request, in_use)
                if error is not None:
                    errors[request.lora_int_id] = error
            if request.lora_int_id in errors:
                failed[request_id] = errors[request.lora_int_id]
        wanted = list(dict.fromkeys(i for i, rid in zip(ids, request_ids)
                                    if i and rid not in failed))
        slots = self.model_lora.slots
        assert len(wanted) <= len(slots), (
            f"{len(wanted)} adapters in one step, more than max_loras {len(slots)} (the "
            f"scheduler bounds them)")
        slot_of = {}
        for lora_int_id in wanted:
            if lora_int_id in slots:
                slot_of[lora_int_id] = slots.index(lora_int_id)
        for lora_int_id in wanted:
            if lora_int_id not in slot_of:
                taken = set(slot_of.values())
                slot = next(s for s, held in enumerate(slots)
                            if s not in taken and (held is None or held not in wanted))
                self.model_lora.set_slot(slot, lora_int_id)
                slot_of[lora_int_id] = slot
        per_request = np.array([slot_of.get(i, -1) if rid not in failed else -1
                                for i, rid in zip(ids, request_ids)], dtype=np.int32)
        row_slots = np.repeat(per_request, num_scheduled)
        return LoRAStep.from_rows(row_slots, self.model_lora.slots), failed

    def step_of(self, states: Sequence, num_scheduled: np.ndarray, batch,
                failed: dict[str, str]) -> LoRAStep | None:
        """`step` for the runner's step: `states` (CachedRequestState, batch order) of
        `batch` (the InputBatch: its requests' adapters stay loaded); requests whose adapter
        cannot be loaded go into `failed` (ModelRunnerOutput.failed)."""
        in_use = {s.lora_request.lora_int_id for s in batch.requests.values()
                  if s.lora_request is not None}
        step, cannot = self.step([s.lora_request for s in states],
                                 [s.request_id for s in states], num_scheduled, in_use)
        failed.update(cannot)
        return step

    def remove(self, lora_int_ids: Sequence[int]) -> None:
        """Free adapters the engine unloaded (none of their requests remain)."""
        for lora_int_id in lora_int_ids:
            self.lru.pop(lora_int_id, None)
            self.model_lora.remove_adapter(lora_int_id)

    @property
    def loaded_ids(self) -> list[int]:
        """Loaded adapters, least recently used first."""
        return list(self.lru)

    # ---- loading -------------------------------------------------------------------------

    def _ensure_loaded(self, request: LoRARequest, in_use: set[int]) -> str | None:
        """Load the request's adapter if it is not (making room after); mark it used.
        The reason where it cannot be loaded, else None."""
        lora_int_id = request.lora_int_id
        if lora_int_id in self.lru:
            self.lru.move_to_end(lora_int_id)
            return None
        try:
            pairs = self._load(request, self.hf_config, self.max_lora_rank)
            self.model_lora.add_adapter(lora_int_id, pairs)
        except (ValueError, OSError) as e:
            error = f"LoRA adapter {request.lora_name!r} failed to load: {e}"
            logger.warning("%s", error)
            return error
        self.lru[lora_int_id] = request
        self._evict(in_use | {lora_int_id})
        logger.info("LoRA adapter %r (id %d) loaded: %d bytes", request.lora_name, lora_int_id,
                    self.model_lora.loaded[lora_int_id])
        return None

    def _evict(self, keep: set[int]) -> None:
        """Drop least recently used adapters beyond max_loaded, except those in `keep` (a
        running request's: then more stay loaded until they finish)."""
        for lora_int_id in list(self.lru):
            if len(self.lru) <= self.max_loaded:
                return
            if lora_int_id not in keep:
                del self.lru[lora_int_id]
                self.model_lora.remove_adapter(lora_int_id)

"""LoRAManager over a real ModelLoRA (tiny random Llama) with a counting loader of
hand-made pairs: adapters load on first use, at most max_loaded stay (least recently used
dropped first, never one a running request holds), a step's adapters keep their slots,
one that cannot load fails its requests alone, and removed ones are freed."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.config import LoRAConfig
from pagoda.executor.lora.manager import LoRAManager
from pagoda.executor.lora.model_lora import ModelLoRA
from pagoda.lora.request import LoRARequest
from tests.executor.test_model_parity import pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint
from tests.lora.test_model_lora import random_pairs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    build_checkpoint("llama", folder)
    return pagoda_runner(folder).model


def request(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def manager_of(model, loads: list[int], **config) -> tuple[LoRAManager, ModelLoRA]:
    def load(req, hf_config, max_rank):
        if req.lora_path == "/bad":
            raise ValueError("no adapter_config.json in /bad")
        loads.append(req.lora_int_id)
        return random_pairs(req.lora_int_id)

    lora = ModelLoRA(model, LoRAConfig(**config).max_loras)
    return LoRAManager(lora, LoRAConfig(**config), model.config, load=load), lora


def run(manager, ids, counts=None, in_use=None):
    reqs = [None if i is None else request(i) for i in ids]
    counts = np.ones(len(ids), np.int64) if counts is None else np.asarray(counts)
    in_use = {i for i in ids if i} if in_use is None else in_use
    return manager.step(reqs, [f"r{k}" for k in range(len(ids))], counts, in_use)


def test_slots_rows_and_lru(model) -> None:
    loads: list[int] = []
    manager, lora = manager_of(model, loads, enable_lora=True, max_loras=2, max_cpu_loras=3)
    try:
        assert run(manager, [None, None]) == (None, {})
        step, failed = run(manager, [1, None, 2, 1], counts=[2, 1, 3, 1])
        assert not failed and loads == [1, 2]
        assert lora.slots == [1, 2]
        assert step.row_slots.tolist() == [0, 0, -1, 1, 1, 1, 0]
        assert dict(step.groups)[2] == slice(3, 6)
        version = lora.version
        step, _ = run(manager, [3, 2])  # 2 keeps its slot, 3 takes 1's
        assert lora.slots == [3, 2] and step.row_slots.tolist() == [0, 1]
        assert lora.version > version
        run(manager, [2])  # recency now: 1, 3, 2
        run(manager, [4])  # a fourth loaded: the least recently used (1) goes
        assert manager.loaded_ids == [3, 2, 4] and sorted(lora.loaded) == [2, 3, 4]
        assert all(1 not in held for layer in lora.adapters for held in layer)
        run(manager, [2])
        assert loads == [1, 2, 3, 4]  # (2 was never loaded again)
        manager.remove([2, 99])
        assert 2 not in lora.loaded and 2 not in lora.slots and manager.loaded_ids == [3, 4]
    finally:
        lora.detach()


def test_running_requests_keep_their_adapters(model) -> None:
    loads: list[int] = []
    manager, lora = manager_of(model, loads, enable_lora=True, max_loras=1)
    try:
        run(manager, [1], in_use={1})
        run(manager, [2], in_use={1, 2})  # 1 still runs (not scheduled this step): kept
        assert sorted(lora.loaded) == [1, 2]
        run(manager, [3], in_use={3})  # now nothing holds 1 or 2: back to max_loaded
        assert manager.loaded_ids == [3] and list(lora.loaded) == [3]
        with pytest.raises(AssertionError, match="max_loras"):
            run(manager, [3, 1])
    finally:
        lora.detach()


def test_an_adapter_that_cannot_load_fails_its_requests_alone(model) -> None:
    loads: list[int] = []
    manager, lora = manager_of(model, loads, enable_lora=True, max_loras=2)
    try:
        bad = LoRARequest("broken", 5, "/bad")
        step, failed = manager.step([request(1), bad, None, bad], ["a", "b", "c", "d"],
                                    np.array([1, 2, 1, 1]), {1, 5})
        assert set(failed) == {"b", "d"}
        assert "'broken' failed to load: no adapter_config.json in /bad" in failed["b"]
        assert step.row_slots.tolist() == [0, -1, -1, -1, -1]
        assert list(lora.loaded) == [1]
    finally:
        lora.detach()

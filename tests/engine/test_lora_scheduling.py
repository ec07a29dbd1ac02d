"""LoRA adapters in the scheduler and the prefix cache, without a model: at most max_loras
distinct adapters run at once, a waiting request of one too many is passed over without
blocking the others, a preempted request keeps its adapter, blocks are shared only under
the same adapter, and a removed adapter is announced to the runner once its last request
has gone."""

from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.engine.core.block_manager import ROOT_HASH, root_hash
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.lora_adapters import LoRAAdapters
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.data_parallel.router import Router, prefix_block_hashes
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams
from tests.engine.scheduler_helpers import BS, EOS, assert_all_free, step

LORAS = {i: LoRARequest(f"adapter{i}", i, f"/adapters/{i}") for i in range(1, 5)}


def lora_scheduler(max_loras: int = 2, num_blocks: int = 64, max_num_seqs: int = 8,
                   policy: str = "fcfs", budget: int = 256) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             scheduling_policy=policy)
    block_manager = KVCacheManager([num_blocks], BS, [None], True)
    return Scheduler(config, block_manager, 256, LoRAAdapters(True, max_loras))


def lora_request(request_id: str, lora_id: int, prompt: list[int] | int = 6,
                 max_tokens: int = 4, priority: int = 0, arrival: float = 0.0) -> Request:
    if isinstance(prompt, int):
        prompt = [100 + hash(request_id) % 50 + i for i in range(prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   [EOS], arrival_time=arrival, priority=priority,
                   lora_request=LORAS.get(lora_id))


def running_loras(sched: Scheduler, out) -> set[int]:
    return {sched.requests[i].lora_int_id for i in out.request_ids
            if i in sched.requests and sched.requests[i].lora_int_id}


def test_at_most_max_loras_adapters_per_step_and_no_head_of_line_blocking():
    sched = lora_scheduler(max_loras=2)
    requests = [lora_request("a1", 1, arrival=1), lora_request("b1", 2, arrival=2),
                lora_request("c1", 3, arrival=3), lora_request("base", 0, arrival=4),
                lora_request("a2", 1, arrival=5), lora_request("c2", 3, arrival=6)]
    for request in requests:
        sched.add_request(request)
    out, _ = step(sched)
    # c1 (a third adapter) is passed over; base and a2, behind it, go in this step
    assert out.request_ids == ["a1", "b1", "base", "a2"]
    assert {new.request_id: new.lora_request for new in out.new_requests} == {
        "a1": LORAS[1], "b1": LORAS[2], "base": None, "a2": LORAS[1]}
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    seen_c = None
    for number in range(1, 40):
        scheduled = {sched.requests[i].lora_int_id for i in out.request_ids
                     if i in sched.requests}
        assert len(scheduled - {0}) <= 2
        assert len({r.lora_int_id for r in sched.running} - {0}) <= 2
        if seen_c is None and any(i.startswith("c") for i in out.request_ids):
            seen_c = number
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched)
    # the c's ran once adapter 2 (b1: its only request) had left, not before
    assert seen_c is not None and all(r.is_finished for r in requests)
    assert_all_free(sched)


def test_a_request_of_a_running_adapter_is_admitted_whatever_the_bound():
    sched = lora_scheduler(max_loras=1)
    for i in range(4):
        sched.add_request(lora_request(f"a{i}", 1, arrival=i))
    sched.add_request(lora_request("b", 2, arrival=10))
    sched.add_request(lora_request("base", 0, arrival=11))
    out, _ = step(sched)
    assert out.request_ids == ["a0", "a1", "a2", "a3", "base"]
    assert running_loras(sched, out) == {1}


def test_priority_scheduling_passes_over_the_adapter_that_does_not_fit():
    sched = lora_scheduler(max_loras=1, policy="priority")
    sched.add_request(lora_request("low", 1, priority=5, arrival=1))
    step(sched)  # adapter 1 runs
    sched.add_request(lora_request("urgent", 2, priority=0, arrival=2))
    sched.add_request(lora_request("next", 1, priority=3, arrival=3))
    out, _ = step(sched)
    assert "urgent" not in out.request_ids and "next" in out.request_ids


def test_a_preempted_request_keeps_its_adapter_and_comes_back_within_the_bound():
    # 5 blocks of 4 tokens for two requests of 8 + 8 tokens: the later one is preempted
    sched = lora_scheduler(max_loras=2, num_blocks=5)
    first = lora_request("first", 1, prompt=7, max_tokens=9, arrival=1)
    second = lora_request("second", 2, prompt=7, max_tokens=9, arrival=2)
    sched.add_request(first)
    sched.add_request(second)
    resumed = []
    for _ in range(60):
        out, _ = step(sched)
        resumed += [new for new in out.new_requests if new.request_id == "second"]
        if not sched.has_unfinished_requests():
            break
    assert second.num_preemptions >= 1 and len(resumed) >= 2
    assert all(new.lora_request == LORAS[2] for new in resumed)
    assert second.lora_request == LORAS[2] and second.num_output_tokens == 9
    assert_all_free(sched)


def test_blocks_are_shared_only_under_the_same_adapter():
    prompt = list(range(200, 213))  # 3 full blocks and a tail
    sched = lora_scheduler(max_loras=4)
    hits = {}
    for request_id, lora_id in [("a", 1), ("a again", 1), ("b", 2), ("base", 0),
                                ("base again", 0)]:
        request = lora_request(request_id, lora_id, prompt=prompt, max_tokens=1)
        sched.add_request(request)
        while sched.has_unfinished_requests():
            step(sched)
        hits[request_id] = request.num_cached_tokens
    assert hits == {"a": 0, "a again": 3 * BS, "b": 0, "base": 0, "base again": 3 * BS}


def test_block_hashes_chain_from_the_adapters_root():
    assert root_hash(0) == ROOT_HASH  # base-model hashes are unchanged
    assert len({root_hash(i) for i in range(50)}) == 50
    sched = lora_scheduler()
    request = lora_request("r", 3, prompt=list(range(9)))
    sched.add_request(request)
    step(sched)
    assert request.block_hashes == prefix_block_hashes(list(range(9)), BS, 3)
    assert request.block_hashes[0] != prefix_block_hashes(list(range(9)), BS)[0]


def test_the_router_matches_prefixes_under_the_same_adapter_only():
    router = Router(2, BS, min_match_fraction=0.5)
    prompt = list(range(40))
    home = router.route("a", prompt, lora_int_id=1)
    assert router.route("b", prompt, lora_int_id=1) == home
    assert router.route("c", prompt, lora_int_id=2) == 1 - home  # no match: least loaded


def test_a_removed_adapter_is_announced_once_its_last_request_has_gone():
    loras = LoRAAdapters(True, 2)
    sched = lora_scheduler()
    sched.loras = loras
    loras.check(LORAS[1])
    loras.check(LORAS[2])
    sched.add_request(lora_request("a1", 1, max_tokens=3))
    sched.add_request(lora_request("a2", 1, max_tokens=6))
    assert loras.remove(1) and not loras.remove(1) and not loras.remove(9)
    assert loras.list() == {2}
    removed = []
    while sched.has_unfinished_requests() or loras.has_pending_removal:
        assert loras.has_pending_removal == (not sched.has_unfinished_requests())
        out, _ = step(sched)
        removed += out.removed_lora_ids
        if removed:
            assert "a2" in out.finished_request_ids  # in the step after the last one ended
            break
    assert removed == [1] and not sched.has_unfinished_requests()
    assert step(sched)[0].removed_lora_ids == []  # once
    # unused: announced by the next schedule
    assert loras.remove(2) and loras.has_pending_removal
    assert sched.schedule().removed_lora_ids == [2]
    assert not loras.has_pending_removal and loras.list() == set() and not loras.known


def test_finished_and_aborted_requests_release_their_adapter():
    sched = lora_scheduler()
    sched.add_request(lora_request("a", 1))
    sched.add_request(lora_request("b", 1))
    assert sched.loras.num_sequences == {1: 2}
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.loras.num_sequences == {1: 1}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.loras.num_sequences == {}

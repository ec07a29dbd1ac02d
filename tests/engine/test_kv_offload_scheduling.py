"""The KV tiers on the scheduling side, without a model: evicted prefix blocks are saved, a
returning prefix is loaded (two phases) and not recomputed, a failed load recomputes from
the first failed block, the index follows the keys the tiers drop, LoRA blocks are never
saved, and --preemption-mode swap saves and restores a victim's blocks.

`TierRunner` plays the runner and the tiers: every pool block holds the token ids its
positions were computed from; saves copy a block's content under its key, loads copy it
back, and each step checks that every position a scheduled request attends to holds that
request's own token, so a wrong load, a missing one or a block overwritten before its save
fails the test.
"""

from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.kv_offload_index import KVOffloadIndex
from pagoda.engine.core.scheduler import Scheduler
from pagoda.lora.request import LoRARequest
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput
from tests.engine.scheduler_helpers import (
    BS,
    TOKEN,
    add,
    block_tables,
    finish_stopped,
    full_pool,
    make_request,
)

BLOCK_BYTES = 100


def make_with_kv_offload(num_blocks: int = 8, host_blocks: int = 64, preemption_mode: str = "recompute",
                max_num_batched_tokens: int = 64, with_kv_offload: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8,
                             preemption_mode=preemption_mode)
    manager = KVCacheManager([num_blocks], BS, [None], enable_prefix_caching=with_kv_offload)
    if with_kv_offload:
        manager.attach_kv_offload(KVOffloadIndex(host_blocks * BLOCK_BYTES, BLOCK_BYTES))
    return Scheduler(config, manager, max_model_len=64)


class KVOffloadRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.blocks: dict[int, list[int | None]] = {}
        self.store: dict[int, list[int | None]] = {}
        self.fail: set[int] = set()
        self.dropped: list[int] = []
        self.outputs: list[SchedulerOutput] = []
        self.computed_tokens = 0

    def step(self) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        self.outputs.append(out)
        tables = block_tables(sched, out)
        for key, block_id, _ in out.kv_saves:
            self.store[key] = list(self.blocks.get(block_id, [None] * BS))
        failures = []
        for key, block_id in out.kv_loads:
            if key in self.fail or key not in self.store:
                failures.append(key)
            else:
                self.blocks[block_id] = list(self.store[key])
        for key in out.kv_drops:
            del self.store[key]
        sampled = []
        for request_id, num_new, table in zip(out.request_ids, out.num_scheduled_tokens, tables):
            request = sched.requests[request_id]
            start, ids = request.num_computed_tokens, table[0]
            for p in range(start):  # what attention reads
                assert self.blocks[ids[p // BS]][p % BS] == request.all_token_ids[p], (
                    request_id, p)
            for p in range(start, start + num_new):
                self.blocks.setdefault(ids[p // BS], [None] * BS)[p % BS] = (
                    request.all_token_ids[p])
            self.computed_tokens += num_new
            sampled.append(TOKEN if start + num_new == request.num_tokens else None)
        result = ModelRunnerOutput(list(out.request_ids), sampled, kv_load_failures=failures,
                                   kv_offload_dropped=self.dropped)
        self.dropped = []
        sched.update_kv_from_output(result)
        finish_stopped(sched, sched.update_from_output(out, result))
        return out

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("not done")


def kv_offload(sched: Scheduler) -> KVOffloadIndex:
    return sched.block_manager.kv_offload


def run_alone(runner: KVOffloadRunner, request) -> None:
    add(runner.sched, request)
    runner.run()


def test_evicting_a_cached_block_queues_its_save() -> None:
    sched = make_with_kv_offload(num_blocks=4)
    runner = KVOffloadRunner(sched)
    a = make_request("a", 3 * BS + 1, max_tokens=1)
    run_alone(runner, a)
    cached = {b.block_hash: b.block_id for b in full_pool(sched).blocks if b.block_hash}
    assert set(cached) == set(a.block_hashes[:3])
    assert kv_offload(sched).keys == set()
    run_alone(runner, make_request("b", 3 * BS + 1, max_tokens=1))  # takes every block
    saves = [save for out in runner.outputs for save in out.kv_saves]
    assert sorted(saves) == sorted((h, cached[h], True) for h in a.block_hashes[:3])
    assert kv_offload(sched).keys == set(a.block_hashes[:3])


def test_a_returning_prefix_is_loaded_not_recomputed() -> None:
    sched = make_with_kv_offload(num_blocks=5)
    runner = KVOffloadRunner(sched)
    prompt = [next_token() for _ in range(4 * BS + 2)]
    a = make_request("a", prompt, max_tokens=1)
    run_alone(runner, a)
    run_alone(runner, make_request("b", 4 * BS + 2, max_tokens=1))  # evicts a's prefix
    assert not any(h in full_pool(sched).cached_blocks for h in a.block_hashes)
    runner.outputs.clear()
    before = runner.computed_tokens
    again = make_request("a2", prompt + [next_token()], max_tokens=1)
    run_alone(runner, again)
    first, second = runner.outputs[0], runner.outputs[1]
    # phase one: a step of loads alone (nothing else runs), no tokens for a2
    assert first.is_empty and [k for k, _ in first.kv_loads] == again.block_hashes[:4]
    # phase two: a2 computes only what follows its loaded blocks
    assert second.request_ids == ["a2"] and second.num_scheduled_tokens == [3]
    assert second.new_requests[0].num_computed_tokens == 4 * BS
    assert runner.computed_tokens - before == 3
    assert kv_offload(sched).hit_tokens == 4 * BS and kv_offload(sched).loaded_blocks == 4
    assert again.num_cached_tokens == 4 * BS
    # the loaded blocks are the pool's cached blocks again
    assert all(h in full_pool(sched).cached_blocks for h in again.block_hashes[:4])


def test_a_failed_load_recomputes_from_the_first_failed_block() -> None:
    sched = make_with_kv_offload(num_blocks=5)
    runner = KVOffloadRunner(sched)
    prompt = [next_token() for _ in range(4 * BS + 2)]
    a = make_request("a", prompt, max_tokens=1)
    run_alone(runner, a)
    run_alone(runner, make_request("b", 4 * BS + 2, max_tokens=1))
    runner.fail = {a.block_hashes[1]}
    runner.outputs.clear()
    again = make_request("a2", list(prompt), max_tokens=1)
    run_alone(runner, again)
    loads, compute = runner.outputs[0], runner.outputs[1]
    assert len(loads.kv_loads) == 4
    # block 0 loaded; block 1 failed: blocks 1.. are recomputed (into the blocks it holds)
    assert compute.new_requests[0].num_computed_tokens == BS
    assert compute.num_scheduled_tokens == [3 * BS + 2]
    assert a.block_hashes[1] not in kv_offload(sched).keys  # forgotten
    assert a.block_hashes[2] in kv_offload(sched).keys  # (its load went fine)
    assert kv_offload(sched).failed_loads == 3 and kv_offload(sched).loaded_blocks == 1


def test_the_index_follows_the_keys_the_tiers_drop() -> None:
    sched = make_with_kv_offload(num_blocks=5)
    runner = KVOffloadRunner(sched)
    prompt = [next_token() for _ in range(4 * BS + 2)]
    a = make_request("a", prompt, max_tokens=1)
    run_alone(runner, a)
    run_alone(runner, make_request("b", 4 * BS + 2, max_tokens=1))
    assert set(a.block_hashes[:4]) <= kv_offload(sched).keys
    runner.dropped = [a.block_hashes[0]]  # the tiers evicted a's first block
    run_alone(runner, make_request("c", 1 * BS, max_tokens=1))
    assert a.block_hashes[0] not in kv_offload(sched).keys
    runner.outputs.clear()
    before = runner.computed_tokens
    run_alone(runner, make_request("a2", list(prompt), max_tokens=1))
    # no tier hit from the first block on: no loads, the prompt computed whole
    assert not any(out.kv_loads for out in runner.outputs)
    assert runner.computed_tokens - before == len(prompt)


def test_lora_blocks_are_never_saved() -> None:
    sched = make_with_kv_offload(num_blocks=4)
    runner = KVOffloadRunner(sched)
    lora = make_request("l", 3 * BS + 1, max_tokens=1)
    lora.lora_request = LoRARequest("adapter", 1, "/nowhere")
    run_alone(runner, lora)
    run_alone(runner, make_request("b", 3 * BS + 1, max_tokens=1))
    assert not any(out.kv_saves for out in runner.outputs)
    assert kv_offload(sched).keys == set()


def preempting_workload(sched: Scheduler) -> KVOffloadRunner:
    """Two requests that outgrow a 6-block pool while decoding: one is preempted."""
    runner = KVOffloadRunner(sched)
    add(sched, make_request("a", 2 * BS + 1, max_tokens=3 * BS),
        make_request("b", 2 * BS + 1, max_tokens=3 * BS))
    runner.run(max_steps=300)
    return runner


def test_swap_saves_the_victims_blocks_and_loads_them_back() -> None:
    recompute = preempting_workload(make_with_kv_offload(num_blocks=6, with_kv_offload=False))
    sched = make_with_kv_offload(num_blocks=6, preemption_mode="swap")
    swap = preempting_workload(sched)
    assert sched.num_preemptions >= 1
    index = kv_offload(sched)
    swap_saves = [s for out in swap.outputs for s in out.kv_saves if not s[2]]
    assert index.swapped_out_blocks == len(swap_saves) > 0
    assert index.swapped_in_blocks == index.swapped_out_blocks
    dropped = [k for out in swap.outputs for k in out.kv_drops]
    assert sorted(dropped) == sorted(k for k, _, _ in swap_saves)
    assert index.swap_bytes_used == 0 and swap.store.keys().isdisjoint(dropped)
    # the swapped-in request computed nothing twice (plain recompute, no cache: more)
    assert swap.computed_tokens < recompute.computed_tokens
    assert swap.computed_tokens == 2 * (2 * BS + 1 + 3 * BS - 1)


def test_swap_falls_back_to_recompute_when_the_host_tier_is_too_small() -> None:
    sched = make_with_kv_offload(num_blocks=6, host_blocks=1, preemption_mode="swap")
    runner = preempting_workload(sched)
    index = kv_offload(sched)
    assert sched.num_preemptions >= 1 and index.swap_fallbacks == sched.num_preemptions
    assert index.swapped_out_blocks == 0
    assert not any(not persistent for out in runner.outputs for _, _, persistent in out.kv_saves)


def test_finishing_a_swapped_out_request_drops_its_entries() -> None:
    sched = make_with_kv_offload(num_blocks=6, preemption_mode="swap")
    runner = KVOffloadRunner(sched)
    add(sched, make_request("a", 2 * BS + 1, max_tokens=3 * BS),
        make_request("b", 2 * BS + 1, max_tokens=3 * BS))
    while not sched.num_preemptions:
        runner.step()
    (victim,) = [r for r in sched.waiting if r.swap is not None]
    keys = list(victim.swap[0])
    sched.finish_requests([victim.request_id], victim.status.FINISHED_ABORTED)
    assert kv_offload(sched).swap_bytes_used == 0
    assert runner.step().kv_drops == keys


_next = iter(range(50_000, 10**9))


def next_token() -> int:
    return next(_next)


def test_a_request_holding_loaded_blocks_goes_first_under_the_priority_policy() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                             scheduling_policy="priority")
    manager = KVCacheManager([5], BS, [None])
    manager.attach_kv_offload(KVOffloadIndex(64 * BLOCK_BYTES, BLOCK_BYTES))
    sched = Scheduler(config, manager, max_model_len=64)
    runner = KVOffloadRunner(sched)
    prompt = [next_token() for _ in range(4 * BS + 2)]
    run_alone(runner, make_request("a", prompt, max_tokens=1))
    run_alone(runner, make_request("b", 4 * BS + 2, max_tokens=1))
    # a2 loads its 4 blocks; then an urgent request that needs every block arrives
    add(sched, make_request("a2", list(prompt), max_tokens=1, priority=5))
    assert runner.step().kv_loads
    add(sched, make_request("urgent", 4 * BS + 2, max_tokens=1, priority=0))
    assert runner.step().request_ids == ["a2"]  # (else both would wait for ever)
    runner.run()
    assert not sched.holding_ids and manager.num_free_blocks == 5

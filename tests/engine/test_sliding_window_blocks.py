"""KV-cache groups of models with sliding-window layers, without a model: the windowed
group holds only its window's blocks, freed blocks serve other requests, preemption and
abort release every group, and the runner's view (built from SchedulerOutputs alone) has
every block attention reads unmasked (pagoda/engine/core/kv_cache_groups.py)."""

from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.core.kv_cache_groups import KVCacheManager, SlidingWindowBlockManager
from pagoda.engine.core.request import RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.step_data import SchedulerOutput
from tests.engine.scheduler_helpers import (
    BS,
    add,
    finish_stopped,
    make_request,
    runner_output,
    step,
)

WINDOW = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_hybrid_scheduler(
    num_blocks: tuple[int, ...] = (64, 16), windows: tuple = (None, WINDOW),
    max_num_batched_tokens: int = 8, max_num_seqs: int = 4, max_model_len: int = 256,
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs)
    block_manager = KVCacheManager(list(num_blocks), BS, list(windows), enable_prefix_caching=True)
    return Scheduler(config, block_manager, max_model_len)


class GroupTablesRunner:
    """The runner's view: one block table per group per request, from SchedulerOutputs only
    (freed windowed blocks are never announced; the stale ids stay)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids + out.preempted_request_ids:
            self.tables.pop(request_id, None)
        for new in out.new_requests:
            assert isinstance(new.block_ids, tuple)
            self.tables[new.request_id] = [list(ids) for ids in new.block_ids]
        for request_id, per_group in out.new_block_ids.items():
            assert isinstance(per_group, tuple) and len({len(ids) for ids in per_group}) == 1
            for table, ids in zip(self.tables[request_id], per_group):
                table.extend(ids)


def check_reads(sched: Scheduler, runner: GroupTablesRunner, out: SchedulerOutput) -> None:
    """Every block a scheduled request reads unmasked this step (full group: all its
    positions; windowed group: from the window of its first new token on) is held by it, is
    what the runner's table says, and belongs to no other request."""
    bm: KVCacheManager = sched.block_manager
    owner: dict[tuple[int, int], str] = {}
    for request_id, num_new in zip(out.request_ids, out.num_scheduled_tokens):
        request = sched.requests[request_id]
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        for g, (group, window) in enumerate(zip(bm.groups, bm.windows)):
            table = runner.tables[request_id][g]
            held = group.block_ids(request_id)
            assert len(table) == len(held) == cdiv(end, BS)
            first = 0 if window is None else max(0, start - window + 1)
            for i in range(first // BS, cdiv(end, BS)):
                if isinstance(group, SlidingWindowBlockManager):
                    assert group.request_blocks[request_id][i] is not None
                assert table[i] == held[i]
                assert owner.setdefault((g, held[i]), request_id) == request_id


def run(sched: Scheduler, runner: GroupTablesRunner, on_step=None, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        runner.apply(out)
        check_reads(sched, runner, out)
        if on_step:
            on_step(out)
        requests = [sched.requests[r] for r in out.request_ids]
        sampled = [7 if r.num_computed_tokens + n == r.num_tokens else None
                   for r, n in zip(requests, out.num_scheduled_tokens)]
        finish_stopped(sched, sched.update_from_output(out, runner_output(out, sampled)))
    raise AssertionError(f"not done after {max_steps} steps")


def assert_all_groups_free(sched: Scheduler) -> None:
    bm: KVCacheManager = sched.block_manager
    for group in bm.groups:
        assert group.num_free_blocks == group.num_blocks
        assert group.request_blocks == {}
    assert sched.requests == {}


def windowed_held(sched: Scheduler, request_id: str) -> int:
    return sched.block_manager.groups[1].num_held_blocks(request_id)


def test_a_long_request_holds_only_its_window_while_the_full_group_grows() -> None:
    sched = make_hybrid_scheduler(max_num_batched_tokens=8)
    runner = GroupTablesRunner()
    add(sched, make_request("a", 30, max_tokens=60))
    full = sched.block_manager.groups[0]
    seen = []

    def on_step(out: SchedulerOutput) -> None:
        request = sched.requests["a"]
        num_new = out.num_scheduled_tokens[0]
        total = request.num_computed_tokens + num_new
        assert len(full.block_ids("a")) == cdiv(total, BS)
        held = windowed_held(sched, "a")
        assert held <= cdiv(WINDOW, BS) + 1 + cdiv(num_new, BS)
        seen.append((total, held))

    run(sched, runner, on_step)
    assert seen[-1][0] == 89 and cdiv(89, BS) == 23  # the full group held 23 blocks at the end
    assert max(held for _, held in seen) <= cdiv(WINDOW, BS) + 1 + 2
    assert all(held <= cdiv(WINDOW, BS) + 1 for total, held in seen if total > 40)  # decodes
    assert_all_groups_free(sched)


def test_freed_window_blocks_serve_other_requests() -> None:
    """Two long requests side by side in a windowed pool of 8 blocks: each alone would
    need 17 without the freeing; no preemption happens."""
    sched = make_hybrid_scheduler(num_blocks=(64, 8), max_num_batched_tokens=4)
    runner = GroupTablesRunner()
    add(sched, make_request("a", 20, max_tokens=48), make_request("b", 12, max_tokens=52))
    windowed = sched.block_manager.groups[1]
    ever_held: dict[str, set[int]] = {"a": set(), "b": set()}

    def on_step(out: SchedulerOutput) -> None:
        for request_id in out.request_ids:
            ever_held[request_id] |= {b for b in windowed.request_blocks[request_id]
                                      if b is not None}

    run(sched, runner, on_step)
    assert sched.num_preemptions == 0
    assert ever_held["a"] & ever_held["b"]  # a block freed by one was taken by the other
    assert_all_groups_free(sched)


def test_preemption_and_abort_release_every_group() -> None:
    # The full pool (12 blocks) cannot hold both requests' 16 + 40 tokens: one is preempted.
    sched = make_hybrid_scheduler(num_blocks=(12, 12), max_num_batched_tokens=16)
    runner = GroupTablesRunner()
    add(sched, make_request("a", 16, max_tokens=24), make_request("b", 16, max_tokens=24))
    run(sched, runner)
    assert sched.num_preemptions > 0
    assert_all_groups_free(sched)

    sched = make_hybrid_scheduler()
    add(sched, make_request("c", 30, max_tokens=40))
    for _ in range(6):
        step(sched)
    assert windowed_held(sched, "c") > 0 and sched.block_manager.num_free_blocks < 80
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert_all_groups_free(sched)


def test_a_model_whose_every_layer_slides_has_only_the_windowed_group() -> None:
    sched = make_hybrid_scheduler(num_blocks=(6,), windows=(WINDOW,), max_num_batched_tokens=4)
    runner = GroupTablesRunner()
    add(sched, make_request("a", 10, max_tokens=40))
    run(sched, runner)  # 50 tokens = 13 blocks in a pool of 6
    assert sched.num_preemptions == 0
    assert_all_groups_free(sched)


def test_one_full_attention_group_is_a_list_of_one_pool_with_prefix_caching() -> None:
    bm = KVCacheManager([16], BS, [None])
    (pool,) = bm.groups
    assert type(pool) is BlockManager and pool.enable_prefix_caching and bm.enable_prefix_caching
    assert bm.sliding_groups == [] and bm.num_blocks == 16
    prompt = list(range(100, 112))
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert bm.allocate_slots(a, 12) == ([0, 1, 2],)
    a.num_computed_tokens = 12
    hits, num_hit_tokens = bm.get_computed_blocks(b)  # never the last token: 2 blocks of 3
    assert num_hit_tokens == 8 and [[blk.block_id for blk in g] for g in hits] == [[0, 1]]
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 4, hits) == ([3],)
    assert bm.block_ids("b") == ([0, 1, 3],)
    b.num_computed_tokens = 12
    assert bm.allocate_slots(b, 0) == ([],)  # nothing new: an empty list for the group
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12, 8)
    hybrid = KVCacheManager([16, 4], BS, [None, WINDOW])
    assert not hybrid.enable_prefix_caching
    assert hybrid.get_computed_blocks(make_request("c", 12)) == ((), 0)


def test_a_request_that_does_not_fit_a_group_changes_nothing() -> None:
    bm = KVCacheManager([2, 8], BS, [None, WINDOW])
    request = make_request("a", 12)
    assert bm.allocate_slots(request, 12) is None  # the full group lacks a block
    assert bm.num_free_blocks == 10 and bm.block_ids("a") == ([], [])
    bm = KVCacheManager([8, 2], BS, [None, WINDOW])
    assert bm.allocate_slots(request, 12) is None  # the windowed group lacks one
    assert bm.num_free_blocks == 10

    request = make_request("b", 16)
    bm = KVCacheManager([8, 3], BS, [None, WINDOW])
    assert bm.allocate_slots(request, 8) == ([0, 1], [0, 1])
    request.num_computed_tokens = 8
    assert bm.allocate_slots(request, 4) == ([2], [2])  # position 8 still sees position 1
    request.num_computed_tokens = 12
    # positions 0-3 are out of the window of position 12: block 0 is freed, then reused
    assert bm.allocate_slots(request, 4) == ([3], [0])
    assert bm.block_ids("b") == ([0, 1, 2, 3], [0, 1, 2, 0])  # (a freed position reads as 0)
    assert bm.groups[1].request_blocks["b"] == [None, 1, 2, 0]
    bm.free(request)
    assert bm.num_free_blocks == bm.num_blocks

"""Shared pieces of the scheduler tests: tiny configs, requests, and the simulated engine loop.

Each simulated step is schedule -> "forward" -> update_from_output -> stop rules, where a
request that reaches its last token this step gets a sampled token and a partial prefill
chunk gets None. The "forward" is a `RecordingRunner`: it keeps the block tables from the
plain-data SchedulerOutput alone, as the real model runner must, so every test also checks
that what the scheduler sends is enough.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pagoda.config import SchedulerConfig
from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.request import Request
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.core.stop_rules import check_stop
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 2
TOKEN = 7  # what the fake model samples unless a test says otherwise

_token_ids = itertools.count(1000)  # fresh prompt tokens, so that prompts never share a prefix
_arrivals = itertools.count(1)


def make_scheduler(
    num_blocks: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    block_manager = KVCacheManager([num_blocks], BS, [None], enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len)


def full_pool(sched: Scheduler) -> BlockManager:
    """The one KV-cache group's pool of a `make_scheduler` scheduler (full attention)."""
    (pool,) = sched.block_manager.groups
    assert isinstance(pool, BlockManager)
    return pool


def make_request(
    request_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    request_max_tokens: int | None = None,
    eos_token_ids: list[int] | None = None,
    **params,
) -> Request:
    """`prompt` is token ids, or a length for fresh tokens that no other prompt shares."""
    if isinstance(prompt, int):
        prompt = [next(_token_ids) for _ in range(prompt)]
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=[EOS] if eos_token_ids is None else eos_token_ids,
        arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time,
        priority=priority,
        max_tokens=request_max_tokens,
    )


def add(sched: Scheduler, *requests: Request) -> None:
    for request in requests:
        sched.add_request(request)


Tables = tuple[list[int], ...]
"""A request's block ids, one list per KV-cache group (a 1-tuple for one group)."""


class RecordingRunner:
    """The runner's view: block tables built from SchedulerOutputs only."""

    def __init__(self) -> None:
        self.block_tables: dict[str, Tables] = {}
        self.last: tuple[SchedulerOutput, list[Tables]] | None = None

    def apply(self, out: SchedulerOutput) -> list[Tables]:
        """Update from `out` (once); the block tables of each scheduled request, in order."""
        if self.last is not None and self.last[0] is out:
            return self.last[1]
        for request_id in out.finished_request_ids + out.preempted_request_ids:
            self.block_tables.pop(request_id, None)
        for new in out.new_requests:
            assert isinstance(new.block_ids, tuple), new.block_ids
            self.block_tables[new.request_id] = tuple(list(ids) for ids in new.block_ids)
        for request_id, per_group in out.new_block_ids.items():
            tables = self.block_tables[request_id]
            assert isinstance(per_group, tuple) and len(per_group) == len(tables), per_group
            assert any(per_group), "a request without new blocks is left out"
            for table, block_ids in zip(tables, per_group):
                table.extend(block_ids)
        tables = [tuple(list(table) for table in self.block_tables[request_id])
                  for request_id in out.request_ids]
        self.last = (out, tables)
        return tables


_runners: dict[int, RecordingRunner] = {}


def block_tables(sched: Scheduler, out: SchedulerOutput) -> list[Tables]:
    """Apply `out` to the scheduler's recording runner; the scheduled block tables."""
    return _runners.setdefault(id(sched), RecordingRunner()).apply(out)


def new_blocks(sched: Scheduler, out: SchedulerOutput) -> dict[str, Tables]:
    """Blocks sent this step: the whole tables of a request new to the runner, the added
    blocks of one it holds."""
    sent = {new.request_id: new.block_ids for new in out.new_requests}
    return {**sent, **out.new_block_ids}


stop_reasons: dict[str, int | None] = {}
"""Request id -> the stop reason of its last finish (a stop token id, or None)."""


def finish_stopped(sched: Scheduler, new_tokens: list[tuple[Request, int]]) -> None:
    """What the engine's lifecycle does with new tokens: apply the token stop rules."""
    for request, token_id in new_tokens:
        stop = check_stop(request, token_id, sched.max_model_len)
        if stop is not None:
            stop_reasons[request.request_id] = stop[1]
            sched.finish_requests([request.request_id], stop[0])


def runner_output(out: SchedulerOutput, sampled: list[int | None]) -> ModelRunnerOutput:
    return ModelRunnerOutput(list(out.request_ids), sampled)


def step(
    sched: Scheduler, sample: Callable[[Request], int] = lambda r: TOKEN
) -> tuple[SchedulerOutput, list[tuple[Request, int]]]:
    out = sched.schedule()
    block_tables(sched, out)
    requests = [sched.requests[request_id] for request_id in out.request_ids]
    sampled = [
        sample(r) if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(requests, out.num_scheduled_tokens)
    ]
    new_tokens = sched.update_from_output(out, runner_output(out, sampled))
    finish_stopped(sched, new_tokens)
    return out, new_tokens


def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    return list(zip(out.request_ids, out.num_scheduled_tokens))


def run_to_completion(sched: Scheduler, sample=lambda r: TOKEN, max_steps: int = 200) -> list:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return batches
        batches.append(batch(step(sched, sample)[0]))
    raise AssertionError(f"not done after {max_steps} steps")


def assert_all_free(sched: Scheduler) -> None:
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    bm = full_pool(sched)
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.request_blocks == {}
    assert bm.num_cached_block_tokens == {}
    assert sched.requests == {}
    assert not sched.running and not sched.waiting
    assert not sched.has_unfinished_requests()

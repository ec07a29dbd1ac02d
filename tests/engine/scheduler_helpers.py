"""Shared pieces of the scheduler tests: tiny configs, requests, and the simulated engine loop.

Each simulated step is schedule -> "forward" -> update_from_output, where a request that
reaches its last token this step gets a sampled token and a partial prefill chunk gets None.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.request import Request
from pagoda.engine.scheduler import Scheduler, SchedulerOutput
from pagoda.sampling_params import SamplingParams

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
        policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching), max_model_len)


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


def step(
    sched: Scheduler, sample: Callable[[Request], int] = lambda r: TOKEN
) -> tuple[SchedulerOutput, list[tuple[Request, int]]]:
    out = sched.schedule()
    sampled = [
        sample(r) if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)
    ]
    return out, sched.update_from_output(out, sampled)


def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)]


def run_to_completion(sched: Scheduler, sample=lambda r: TOKEN, max_steps: int = 200) -> list:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return batches
        batches.append(batch(step(sched, sample)[0]))
    raise AssertionError(f"not done after {max_steps} steps")


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.request_blocks == {}
    assert bm.num_cached_block_tokens == {}
    assert sched.requests == {}
    assert not sched.running and not sched.waiting
    assert not sched.has_unfinished_requests()

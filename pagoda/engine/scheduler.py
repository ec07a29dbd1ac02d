"""Continuous batching under a token budget. Pure Python: no torch here.

The one rule: every request has num_tokens (prompt + generated) and num_computed_tokens; each
step hands out at most `max_num_batched_tokens` tokens so that computed catches up with total.
A new prompt gets as many tokens as the budget allows (chunked prefill), a running request
with one new token gets one (decode), a request with prefix-cache hits starts computed>0,
and a preempted request starts again from 0: all the same rule, no separate prefill path.

Order of a step: running requests first (in admission order), then waiting ones while the
budget, `max_num_seqs` and free blocks allow. When a running request cannot get a block, the
lowest-priority (largest priority value, then latest arrival) running request is preempted:
its blocks are freed and it returns to the front of the waiting queue, to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled_requests: list[Request] = field(default_factory=list)
    """Requests that run this step, in batch order."""
    num_scheduled_tokens: list[int] = field(default_factory=list)
    """Tokens each scheduled request computes this step (aligned with scheduled_requests)."""
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    """Blocks allocated this step, per request id."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Whole block table of each scheduled request (aligned with scheduled_requests)."""
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the previous step; the executor drops their state."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_request_ids: list[str] = []
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt is {request.num_tokens} tokens, longer than the maximum model length "
                f"of {self.max_model_len} tokens"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, or a stop found by the detokenizer); frees their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self.finished_request_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------

    def _victim_key(self, request: Request) -> tuple:
        """Larger key = preempted first."""
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. Running requests, oldest first. A request that cannot get its blocks preempts
        #    the worst running request (possibly itself) until it fits.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                scheduled_ids.add(request.request_id)
                index += 1
                continue
            while True:
                new_block_ids = self.block_manager.allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                victim = max(
                    (r for r in self.running if r.request_id not in scheduled_ids),
                    key=self._victim_key,
                )
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # `request` itself was preempted; running[index] is the next one
            self._add_to_output(output, request, num_new, new_block_ids)
            scheduled_ids.add(request.request_id)
            budget -= num_new
            index += 1

        # 2. Waiting requests, while there is room; none if anything was preempted this step.
        while (
            self.waiting
            and budget > 0
            and not output.preempted_request_ids
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._next_waiting()
            computed_blocks, num_computed = [], 0
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                # (prompt logprobs need every prompt position computed, so no cache hits)
                computed_blocks, num_computed = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_computed
            new_block_ids = self.block_manager.allocate_slots(request, num_new, computed_blocks)
            if new_block_ids is None:
                request.num_computed_tokens = 0
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.time()
            self._add_to_output(output, request, num_new, new_block_ids)
            budget -= num_new

        output.finished_request_ids = self.finished_request_ids
        self.finished_request_ids = []
        return output

    def _add_to_output(
        self, output: SchedulerOutput, request: Request, num_new: int, new_block_ids: list[int]
    ) -> None:
        output.scheduled_requests.append(request)
        output.num_scheduled_tokens.append(num_new)
        output.new_block_ids[request.request_id] = new_block_ids
        output.block_ids.append(self.block_manager.block_ids(request.request_id))

    # ---- after the forward -----------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[int | None]
    ) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens, finish requests that stop.

        sampled_token_ids[i] is None for a request whose step ended inside its prompt (a
        partial prefill chunk): nothing is sampled for it. Returns the (request, new token)
        pairs; finished requests have their status set and their blocks freed.
        """
        new_tokens = []
        for request, num_tokens, token_id in zip(
            output.scheduled_requests, output.num_scheduled_tokens, sampled_token_ids
        ):
            if request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted while its step ran
            request.num_computed_tokens += num_tokens
            if token_id is None:
                continue
            request.append_output_token(token_id)
            new_tokens.append((request, token_id))
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
        return new_tokens

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        # max_tokens None (no cap given) leaves the max_model_len check above as the limit.
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

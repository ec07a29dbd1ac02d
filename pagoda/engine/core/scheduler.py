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
(The block manager has a pool per KV-cache group, one unless the model has sliding-window
layers, and answers `allocate_slots` for all groups at once: kv_cache_groups.py. Block ids
are a tuple with one list per group.)

LoRA adapters (lora_adapters.py): at most `max_loras` distinct adapters among the running
requests (base-model requests do not count), so any step's batch holds at most that many.
A waiting request whose adapter would be one too many is passed over for this step, and the
next waiting request that fits may go (no head-of-line blocking across adapters); it is
admitted once a running adapter's last request leaves. A preempted request keeps its
adapter. Adapters removed (LoRAAdapters.remove) whose last request has gone are announced
once in SchedulerOutput.removed_lora_ids.

A pooling (embedding) request follows the same rule: it is scheduled until its prompt is
computed, samples nothing, and the lifecycle finishes it in the step its vector comes back
(mean and CLS pooling take no prefix-cache hits: Request.can_use_prefix_cache).

KV tiers (kv_offload_index.py; on with --kv-offload-memory / --kv-offload-dir): a waiting
request whose prefix goes on in the tiers, or one swapped out, is admitted by loading its
blocks (scheduler_kv_offload.py says how).

The scheduler decides who runs; it does not decide who stops. Stop rules (EOS, stop ids,
stop strings, length, abort) are applied by the request lifecycle (lifecycle.py), which
tells the scheduler which ids to finish (`finish_requests`); the scheduler frees them.
What it hands the runner is plain data (pagoda/step_data.py), never its Request objects.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.lora_adapters import LoRAAdapters
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler_kv_offload import KVOffloadScheduling
from pagoda.step_data import ModelRunnerOutput, NewRequestData, SchedulerOutput


class Scheduler(KVOffloadScheduling):
    def __init__(
        self, config: SchedulerConfig, block_manager: KVCacheManager,
        max_model_len: int, loras: LoRAAdapters | None = None,
    ):
        """`loras`: the engine's adapters (None: LoRA off: no request names one)."""
        self.config = config
        self.loras = loras if loras is not None else LoRAAdapters(False, 1)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_request_ids: list[str] = []
        self.loading: list[Request] = []
        """Requests whose blocks this step loads from the KV tiers (empty between steps)."""
        self.holding_ids: set[str] = set()
        """Waiting requests that hold blocks loaded from the tiers: admitted before any other
        waiting request, whatever the policy (they would otherwise sit on blocks the one
        chosen may need)."""
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0
        """Prompt tokens run through the model (cache hits excluded, recomputes included)."""

    # ---- queue management ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (validated at the edge: pagoda/engine/core/input_processor.py)."""
        assert request.num_tokens <= self.max_model_len, request
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.loras.hold(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (a stop rule or an abort, decided by the lifecycle); frees their
        blocks. Unknown or already finished ids are skipped."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.loading:
                self.loading.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.swap is not None:
            self.block_manager.kv_offload.drop_swap(request.swap[0])
            request.swap = None
        request.kv_loads = None
        self.holding_ids.discard(request.request_id)
        self.block_manager.free(request)
        self.loras.release(request)
        del self.requests[request.request_id]
        self.finished_request_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- scheduling ------------------------------------------------------------------------

    def _victim_key(self, request: Request) -> tuple:
        """Larger key = preempted first."""
        if self.config.scheduling_policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def _next_waiting(self, passed_over: set[int]) -> Request | None:
        """The next waiting request to admit, skipping those of the adapters in
        `passed_over` (they do not fit this step); None when only such are left."""
        candidates = self.waiting
        if passed_over:
            candidates = [r for r in self.waiting if r.lora_int_id not in passed_over]
            if not candidates:
                return None
        if self.holding_ids:  # (at the front of the queue: found at once)
            holding = next((r for r in candidates if r.request_id in self.holding_ids), None)
            if holding is not None:
                return holding
        if self.config.scheduling_policy == "priority":
            return min(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[0]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        if self.config.preemption_mode == "swap":
            self._swap_out(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """One step's batch: the running phase, then the waiting phase (none if the first
        preempted anything), then what the step carries besides (finished ids, removed
        adapters, the KV tiers' copies)."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        self._schedule_waiting(output, budget)
        for request_id, num_new in zip(output.request_ids, output.num_scheduled_tokens):
            request = self.requests[request_id]
            start = min(request.num_computed_tokens, request.num_prompt_tokens)
            end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
            self.num_computed_prompt_tokens += end - start
        output.finished_request_ids = self.finished_request_ids
        self.finished_request_ids = []
        output.removed_lora_ids = self.loras.take_removed()
        if self.block_manager.kv_offload is not None:
            output.kv_saves, output.kv_loads, output.kv_drops = self.block_manager.kv_offload.take()
        return output

    # ---- the running phase -----------------------------------------------------------------

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        """Running requests, oldest first, each its tokens to catch up (and its proposals to
        verify) within `budget`; returns the budget left. A request that cannot get its
        blocks preempts the worst running request (possibly itself) until it fits."""
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            spec_ids = self._spec_to_verify(request, num_new, budget)
            num_new += len(spec_ids)
            if num_new <= 0:
                scheduled_ids.add(request.request_id)
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, scheduled_ids, output)
            if new_block_ids is None:
                continue  # `request` itself was preempted; running[index] is the next one
            output.request_ids.append(request.request_id)
            output.num_scheduled_tokens.append(num_new)
            if any(new_block_ids):  # (a list per group, empty where nothing is new)
                output.new_block_ids[request.request_id] = new_block_ids
            if spec_ids:
                output.spec_token_ids[request.request_id] = spec_ids
            scheduled_ids.add(request.request_id)
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled_ids: set[str],
                             output: SchedulerOutput) -> tuple | None:
        """Slots for `num_new` more tokens of a running request, preempting the worst
        running request not yet scheduled this step until they fit; None if `request`
        itself was preempted."""
        while True:
            new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = max(
                (r for r in self.running if r.request_id not in scheduled_ids),
                key=self._victim_key,
            )
            self._preempt(victim)
            output.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return None

    def _spec_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's proposals that run this step: only after its last token (a
        decode), within the budget left, and never past max_tokens (the step emits up to one
        token more than it verifies) or max_model_len."""
        if not request.spec_token_ids or request.num_computed_tokens + num_new != request.num_tokens:
            return []
        room = min(budget - num_new, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[: max(room, 0)]

    # ---- the waiting phase -----------------------------------------------------------------

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Waiting requests, while there is room; none if anything was preempted this step.
        Each is admitted by its kind: swapped in, loaded from the tiers, or run (fresh, or
        holding blocks loaded earlier). A request whose adapter would exceed max_loras is
        passed over (all of that adapter's are: the running set only grows within a step).
        The first that does not fit ends the phase."""
        active_loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        passed_over: set[int] = set()
        while (
            self.waiting
            and budget > 0
            and not output.preempted_request_ids
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            request = self._next_waiting(passed_over)
            if request is None:
                break
            if not self.loras.fits(active_loras, request.lora_int_id):
                passed_over.add(request.lora_int_id)
                continue
            if request.swap is not None:  # swapped out: its blocks come back from the host tier
                if not self._admit_swap_in(request):
                    break
                continue
            computed_blocks, num_computed, offload_keys = self._cached_start(request)
            if offload_keys:
                if not self._admit_kv_offload_load(request, computed_blocks, num_computed,
                                                   offload_keys):
                    break
                continue
            num_new = self._admit_fresh(request, computed_blocks, num_computed, budget, output)
            if num_new is None:
                break
            if request.lora_int_id:
                active_loras.add(request.lora_int_id)
            budget -= num_new

    def _cached_start(self, request: Request) -> tuple[tuple, int, list[int]]:
        """(the pool's prefix-cache hits, tokens computed with them, the tiers' hit keys
        past them) of a waiting request; one holding blocks loaded earlier starts from
        what they hold."""
        if self.block_manager.holds_blocks(request.request_id):
            return (), request.num_computed_tokens, []  # (its blocks were loaded)
        if request.num_computed_tokens == 0 and request.can_use_prefix_cache:
            computed_blocks, num_computed = self.block_manager.get_computed_blocks(request)
            return (computed_blocks, num_computed,
                    self.block_manager.get_kv_offload_hits(request, num_computed))
        return (), 0, []

    def _admit_fresh(self, request: Request, computed_blocks: tuple, num_computed: int,
                     budget: int, output: SchedulerOutput) -> int | None:
        """Run a waiting request from `num_computed` on: its slots, and its NewRequestData
        in `output`; the tokens it gets, or None, changing nothing, if it does not fit
        (the budget without chunked prefill, or the free blocks)."""
        num_new = request.num_tokens - num_computed
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        computed_before = request.num_computed_tokens  # (not 0: blocks loaded earlier)
        request.num_computed_tokens = num_computed
        new_block_ids = self.block_manager.allocate_slots(request, num_new, computed_blocks)
        if new_block_ids is None:
            request.num_computed_tokens = computed_before
            return None
        self.waiting.remove(request)
        self.running.append(request)
        self.holding_ids.discard(request.request_id)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
            request.first_scheduled_time = time.time()
        output.new_requests.append(NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.block_manager.block_ids(request.request_id),  # a fresh copy
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        ))
        output.request_ids.append(request.request_id)
        output.num_scheduled_tokens.append(num_new)
        return num_new

    # ---- after the forward -----------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, int]]:
        """Advance computed counts and append the sampled tokens; returns the (request, new
        token) pairs, in order, for the lifecycle to check against the stop rules.

        A request's sampled token is None when its step ended inside its prompt (a partial
        prefill chunk). Requests finished (aborted) while their step ran are skipped. A
        request that verified proposals gains its accepted ones, then the sampled token; the
        KV of the rejected ones is rolled back (not computed, their blocks freed). Each
        request takes its new proposals for the next step."""
        new_tokens = []
        for request_id, num_tokens, token_id in zip(
            output.request_ids, output.num_scheduled_tokens, runner_output.sampled_token_ids
        ):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            spec_ids = output.spec_token_ids.get(request_id, ())
            num_accepted = runner_output.num_accepted_tokens.get(request_id, 0)
            request.num_computed_tokens += num_tokens - (len(spec_ids) - num_accepted)
            if num_accepted < len(spec_ids):
                self.block_manager.rollback_slots(request)
            request.spec_token_ids = runner_output.spec_token_ids.get(request_id, [])
            if token_id is None:
                continue
            for new_token_id in [*spec_ids[:num_accepted], token_id]:
                request.append_output_token(new_token_id)
                new_tokens.append((request, new_token_id))
            if num_accepted:
                # accepted proposals were not the request's tokens when its blocks were
                # registered: blocks they filled are cached now
                self.block_manager.cache_computed_blocks(request)
        return new_tokens

"""The scheduler's side of the KV tiers (kv_offload_index.py; on with --kv-offload-memory /
--kv-offload-dir): admitting a waiting request by loading its blocks, swapping a victim
out, and the loads' outcome after the step. Pure Python: no torch here.

A waiting request whose prefix goes on past the pool's hits in the tiers is admitted in
two phases. This step it gets blocks for its pool and tier hits and the step carries loads
for the latter; it computes nothing (it sits in `loading`, unknown to the runner). After the step
(update_kv_from_output) its num_computed_tokens counts every block up to the first failed
load (the rest are recomputed), those blocks are registered as cached, and it returns to
the front of the waiting queue holding its blocks; it runs from the next step on.
With --preemption-mode swap a victim's blocks are saved under swap keys when the host tier
has room (else it recomputes), and loaded back the same way when it resumes.
"""

from __future__ import annotations

from collections import deque

from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.kv_offload_index import swap_key
from pagoda.engine.core.request import Request
from pagoda.step_data import ModelRunnerOutput


class KVOffloadScheduling:
    """Scheduler's methods for the KV tiers (a base class of scheduler.Scheduler, which
    holds the state they use)."""

    block_manager: KVCacheManager
    waiting: deque[Request]
    loading: list[Request]
    holding_ids: set[str]

    def _swap_out(self, request: Request) -> None:
        """Save the victim's computed blocks (the partial last one too) under swap keys,
        if the host tier has room for them; else it recomputes when it resumes."""
        kv_offload = self.block_manager.kv_offload
        num_blocks = -(-request.num_computed_tokens // self.block_manager.block_size)
        if kv_offload is None or num_blocks == 0:
            return
        if not kv_offload.swap_room(num_blocks):
            kv_offload.swap_fallbacks += 1
            return
        block_ids = self.block_manager.block_ids(request.request_id)[0][:num_blocks]
        tag = f"{request.request_id}#{request.num_preemptions}"
        keys = [swap_key(tag, i) for i in range(num_blocks)]
        kv_offload.save_swap(keys, block_ids)
        request.swap = (keys, request.num_computed_tokens)

    def _admit_kv_offload_load(self, request: Request, computed_blocks: tuple,
                               num_computed: int, offload_keys: list[int]) -> bool:
        """A fresh request whose prefix goes on in the tiers: load those blocks this step
        (_admit_loading), counted as tier hits; False if too few blocks are free."""
        if not self._admit_loading(request, computed_blocks, num_computed, offload_keys,
                                   swap=False):
            return False
        block_size = self.block_manager.block_size
        self.block_manager.kv_offload.hit_tokens += len(offload_keys) * block_size
        return True

    def _admit_swap_in(self, request: Request) -> bool:
        """A swapped-out request: its saved blocks come back from the host tier this step
        (_admit_loading); False if too few blocks are free."""
        keys, _ = request.swap
        return self._admit_loading(request, (), 0, keys, swap=True)

    def _admit_loading(self, request: Request, computed_blocks: tuple, num_computed: int,
                       keys: list[int], swap: bool) -> bool:
        """Give a waiting request its pool hits and blocks for `keys`, loaded from the
        tiers this step (see the module docstring); False, changing nothing, if too few
        blocks are free."""
        new_ids = self.block_manager.allocate_loading(request, computed_blocks, len(keys))
        if new_ids is None:
            return False
        self.block_manager.kv_offload.load(list(zip(keys, new_ids)))
        request.num_computed_tokens = num_computed
        request.kv_loads = (keys, num_computed // self.block_manager.block_size, swap)
        self.waiting.remove(request)
        self.loading.append(request)
        return True

    # ---- after the forward -----------------------------------------------------------------

    def update_kv_from_output(self, runner_output: ModelRunnerOutput | None) -> None:
        """After every step with tiers (before update_from_output): learn which keys the
        tiers lost, and finish the loading requests (see the module docstring). None: the
        step failed, so every load counts as failed."""
        kv_offload = self.block_manager.kv_offload
        if kv_offload is None:
            return
        if runner_output is None:
            failures = {key for r in self.loading for key in r.kv_loads[0]}
        else:
            failures = set(runner_output.kv_load_failures)
            kv_offload.forget(runner_output.kv_offload_dropped)
            kv_offload.add_stats(runner_output.kv_offload_stats)
        kv_offload.forget(failures)
        block_size = self.block_manager.block_size
        for request in self.loading:
            keys, first_block, swap = request.kv_loads
            request.kv_loads = None
            num_loaded = next((i for i, key in enumerate(keys) if key in failures), len(keys))
            kv_offload.loaded_blocks += num_loaded
            kv_offload.failed_loads += len(keys) - num_loaded
            computed = (first_block + num_loaded) * block_size
            if swap:
                _, swapped_computed = request.swap
                computed = min(computed, swapped_computed)
                kv_offload.drop_swap(keys)
                kv_offload.swapped_in_blocks += num_loaded
                request.swap = None
            # The tokens past `computed` (a failed block and all after it) are recomputed
            # into the blocks already held; the last token is never counted computed.
            request.num_computed_tokens = min(computed, request.num_tokens - 1)
            self.block_manager.cache_computed_blocks(request)
            self.holding_ids.add(request.request_id)
        self.waiting.extendleft(reversed(self.loading))  # first admitted, first again
        self.loading = []

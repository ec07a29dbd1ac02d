"""The model runner's own record of the requests it runs, kept across steps and updated in
place from the plain-data SchedulerOutput (vLLM's InputBatch idea): a request's token ids
and block table are sent once, when it joins the batch; after that only new block ids come,
and the runner appends the tokens it samples itself.

One row per request, in arrays that grow (doubling) when a request or the batch outgrows
them; a row is reused once its request leaves:

    token_ids    (rows, width)       prompt then output tokens; num_tokens[row] are valid
    block_tables [(rows, max_blocks)] the request's KV blocks, one table per KV-cache group
                                     (one unless the model has sliding-window layers, see
                                     pagoda/engine/core/kv_cache_groups.py); num_blocks[row] of
                                     each are valid (every group's table has that length)
    num_computed (rows,)             tokens whose KV is in the cache
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import NewRequestData


@dataclass
class CachedRequestState:
    request_id: str
    row: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    """Set for a pooling request: it samples nothing (executor/pooling.py)."""
    pooled: Any = None
    """A pooling request's state between prefill chunks (a tensor: mean's running sum of
    hidden states, CLS's first one); dropped with the request (preemption restarts it)."""
    lora_request: LoRARequest | None = None
    """The adapter its rows run with (None: the base model); executor/lora/manager.py."""


class InputBatch:
    def __init__(
        self, num_rows: int = 8, width: int = 256, max_blocks: int = 16,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.token_ids = np.zeros((num_rows, width), dtype=np.int64)
        self.block_tables = [np.zeros((num_rows, max_blocks), dtype=np.int64)
                             for _ in range(num_kv_cache_groups)]
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.num_computed = np.zeros(num_rows, dtype=np.int64)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    # ---- membership --------------------------------------------------------------------------

    def add(self, new: NewRequestData) -> CachedRequestState:
        assert new.request_id not in self.requests, new.request_id
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        num_tokens = len(new.token_ids)
        per_group = new.block_ids  # one list per KV-cache group, of equal lengths
        assert len(per_group) == len(self.block_tables), (len(per_group), len(self.block_tables))
        num_blocks = len(per_group[0])
        self._fit(num_tokens, num_blocks)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.num_tokens[row] = num_tokens
        for table, block_ids in zip(self.block_tables, per_group):
            table[row] = 0  # no stale ids of the row's previous request
            table[row, :num_blocks] = block_ids
        self.num_blocks[row] = num_blocks
        self.num_computed[row] = new.num_computed_tokens
        state = CachedRequestState(
            new.request_id, row, new.sampling_params,
            prompt_token_ids=list(new.token_ids[: new.num_prompt_tokens]),
            output_token_ids=list(new.token_ids[new.num_prompt_tokens:]),
            pooling_params=new.pooling_params, lora_request=new.lora_request,
        )
        self.requests[new.request_id] = state
        return state

    def remove(self, request_id: str) -> None:
        """Drop a request (finished or preempted); unknown ids are ignored."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    # ---- in-place updates --------------------------------------------------------------------

    def append_blocks(self, request_id: str, per_group: tuple[list[int], ...]) -> None:
        """Extend the request's tables by one list of new block ids per KV-cache group."""
        row = self.requests[request_id].row
        start, count = int(self.num_blocks[row]), len(per_group[0])
        self._fit(0, start + count)
        for table, ids in zip(self.block_tables, per_group):
            table[row, start : start + count] = ids
        self.num_blocks[row] = start + count

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        row = state.row
        position = int(self.num_tokens[row])
        self._fit(position + 1, 0)
        self.token_ids[row, position] = token_id
        self.num_tokens[row] = position + 1
        state.output_token_ids.append(token_id)

    def write_proposals(self, state: CachedRequestState, token_ids) -> int:
        """Put proposals to verify after the request's tokens, uncounted (the tokens the
        request then emits overwrite them). Returns how many."""
        row, start = state.row, int(self.num_tokens[state.row])
        self._fit(start + len(token_ids), 0)
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        return len(token_ids)

    def roll_back(self, state: CachedRequestState, num_rejected: int, block_size: int) -> None:
        """Forget the KV of rejected proposals: num_computed goes back, and the blocks past
        it leave the table (the scheduler freed them: BlockManager.rollback_slots)."""
        row = state.row
        self.num_computed[row] -= num_rejected
        self.num_blocks[row] = -(-int(self.num_computed[row]) // block_size)

    # ---- growth ------------------------------------------------------------------------------

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        self.token_ids = _grown(self.token_ids, 2 * old, self.token_ids.shape[1])
        self.block_tables = [_grown(t, 2 * old, t.shape[1]) for t in self.block_tables]
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(old, np.int64)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(old, np.int64)])
        self.num_computed = np.concatenate([self.num_computed, np.zeros(old, np.int64)])
        self.free_rows = list(range(2 * old - 1, old - 1, -1)) + self.free_rows

    def _fit(self, num_tokens: int, num_blocks: int) -> None:
        rows, width = self.token_ids.shape
        if num_tokens > width:
            self.token_ids = _grown(self.token_ids, rows, max(2 * width, num_tokens))
        max_blocks = self.block_tables[0].shape[1]
        if num_blocks > max_blocks:
            self.block_tables = [_grown(t, rows, max(2 * max_blocks, num_blocks))
                                 for t in self.block_tables]


def _grown(array: np.ndarray, rows: int, columns: int) -> np.ndarray:
    grown = np.zeros((rows, columns), dtype=array.dtype)
    grown[: array.shape[0], : array.shape[1]] = array
    return grown

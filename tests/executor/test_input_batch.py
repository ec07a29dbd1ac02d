"""The runner's batch record (pagoda/executor/input_batch.py) takes block ids in one shape:
a tuple with one list per KV-cache group, for one group as for several."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.executor.input_batch import InputBatch
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import NewRequestData


def new_request(request_id: str, block_ids: tuple[list[int], ...], num_tokens: int = 6):
    return NewRequestData(request_id, list(range(100, 100 + num_tokens)), num_tokens,
                          SamplingParams(), block_ids, num_computed_tokens=0)


def table_rows(batch: InputBatch, request_id: str) -> list[list[int]]:
    row = batch.requests[request_id].row
    return [table[row, : batch.num_blocks[row]].tolist() for table in batch.block_tables]


@pytest.mark.parametrize("block_ids, added", [
    (([3, 1],), ([7],)),                   # one group: a 1-tuple
    (([3, 1], [0, 2]), ([7], [5])),        # full attention + sliding window
])
def test_tables_are_filled_and_extended_per_group(block_ids, added) -> None:
    batch = InputBatch(num_rows=2, max_blocks=2, num_kv_cache_groups=len(block_ids))
    batch.add(new_request("a", block_ids))
    assert table_rows(batch, "a") == [list(ids) for ids in block_ids]
    batch.append_blocks("a", added)  # outgrows max_blocks: the tables widen
    assert table_rows(batch, "a") == [ids + more for ids, more in zip(block_ids, added)]
    assert all(table.shape[1] >= 3 for table in batch.block_tables)


def test_a_reused_row_keeps_no_stale_block_ids() -> None:
    batch = InputBatch(num_rows=1, max_blocks=4, num_kv_cache_groups=2)
    batch.add(new_request("a", ([1, 2, 3], [4, 5, 6]), num_tokens=10))
    batch.remove("a")
    batch.add(new_request("b", ([9], [8]), num_tokens=2))
    row = batch.requests["b"].row
    assert [table[row].tolist() for table in batch.block_tables] == [[9, 0, 0, 0], [8, 0, 0, 0]]
    assert batch.num_blocks[row] == 1 and np.array_equal(batch.token_ids[row, :2], [100, 101])


def test_block_ids_for_another_number_of_groups_are_refused() -> None:
    batch = InputBatch(num_kv_cache_groups=2)
    with pytest.raises(AssertionError):
        batch.add(new_request("a", ([1, 2],)))

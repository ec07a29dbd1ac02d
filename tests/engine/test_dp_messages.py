"""What crosses a data-parallel replica's pipe pickles, errors keep the class the server
maps to a status, and replicas' snapshots add up with counters that survive a restart."""

from __future__ import annotations

import pickle

import pytest

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Batch,
    Dead,
    Error,
    Failed,
    Out,
    Ready,
    ReplicaInfo,
    Snapshot,
    Stop,
    decode_error,
    encode_error,
    snapshot_fields,
)
from pagoda.engine.data_parallel.replica_slot import ReplicaSlot
from pagoda.engine.data_parallel.snapshots import counters_only, merge_snapshots
from pagoda.engine.loop.request_stream import EngineDeadError, EngineStepError, QueueFullError
from pagoda.engine.stats.snapshot import EngineSnapshot, SpecDecodeTotals
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams


def snapshot(**fields) -> EngineSnapshot:
    base = {"num_kv_blocks": 100, "num_free_kv_blocks": 80, "kv_block_size": 16,
            "kv_cache_usage": 0.2, "kv_group_num_blocks": (100,),
            "kv_group_num_free_blocks": (80,)}
    return EngineSnapshot(**{**base, **fields})


def test_requests_outputs_and_snapshots_pickle():
    params = SamplingParams(temperature=0, max_tokens=4, stop=["x"], logit_bias={3: 1.0})
    request = EngineRequest("r", "hi", [1, 2], params, 4, 1.0, grammar='{"type": "object"}')
    assert pickle.loads(pickle.dumps(request)) == request
    output = RequestOutput("r", "hi", [1, 2], [CompletionOutput(0, "a", [5], finish_reason=None,
                                                                delta_token_ids=[5])],
                           finished=False, metrics=RequestMetrics(arrival_time=1.0))
    assert pickle.loads(pickle.dumps(output)) == output
    original = snapshot(running_request_ids=("a",), finished_by_reason={"stop": 2},
                        batch_sizes={3: 1}, spec_decode=SpecDecodeTotals(1, 3, 2, (1, 1)))
    with pytest.raises(TypeError):
        pickle.dumps(original)  # read-only mappings: hence snapshot_fields
    assert EngineSnapshot(**pickle.loads(pickle.dumps(snapshot_fields(original)))) == original


def test_every_pipe_message_is_a_typed_dataclass_that_pickles():
    request = EngineRequest("r", "hi", [1, 2], SamplingParams(max_tokens=2), 4, 1.0)
    output = RequestOutput("r", "hi", [1, 2], [], finished=True)
    info = ReplicaInfo(7, 2048, 100, [2], 8, 64, 16, 1024, None, 1)
    messages = [
        Add(request), Abort("r"), Stop(), Ready(info), Failed("no model"), Dead("bug"),
        Batch([Added("r"), Out("r", output), Error("r", encode_error(ValueError("v"))),
               Snapshot(snapshot_fields(snapshot(num_generation_tokens=3)))]),
    ]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
    rebuilt = pickle.loads(pickle.dumps(messages[-1])).items[-1].rebuild()
    assert rebuilt.num_generation_tokens == 3 and rebuilt.num_kv_blocks == 100


def test_errors_keep_their_class_and_fields():
    error = decode_error(encode_error(InvalidRequestError("bad max_tokens", "max_tokens",
                                                          "too_long")))
    assert isinstance(error, InvalidRequestError)
    assert (error.message, error.param, error.code) == ("bad max_tokens", "max_tokens",
                                                        "too_long")
    for cls in (EngineDeadError, EngineStepError, QueueFullError):
        error = decode_error(encode_error(cls("boom")))
        assert type(error) is cls and str(error) == "boom"
    assert type(decode_error(encode_error(ValueError("v")))) is ValueError
    other = decode_error(encode_error(KeyError("k")))
    assert isinstance(other, EngineStepError) and "KeyError" in str(other)


def test_merge_adds_counts_and_weights_kv_usage():
    a = snapshot(running_request_ids=("a",), num_running_seqs=1, num_generation_tokens=10,
                 prefix_cache_hits=32, finished_by_reason={"stop": 1}, batch_sizes={1: 4},
                 spec_decode=SpecDecodeTotals(1, 2, 1, (1,)))
    b = snapshot(num_kv_blocks=300, num_free_kv_blocks=0, kv_cache_usage=1.0,
                 kv_group_num_blocks=(300,), kv_group_num_free_blocks=(0,),
                 waiting_request_ids=("b",), num_waiting_seqs=2, num_generation_tokens=5,
                 finished_by_reason={"stop": 2, "length": 1}, batch_sizes={1: 1, 2: 3},
                 spec_decode=SpecDecodeTotals(2, 6, 3, (2, 1)))
    merged = merge_snapshots([a, b])
    assert merged.running_request_ids == ("a",) and merged.waiting_request_ids == ("b",)
    assert (merged.num_running_seqs, merged.num_waiting_seqs) == (1, 2)
    assert (merged.num_kv_blocks, merged.num_free_kv_blocks) == (400, 80)
    assert merged.kv_group_num_blocks == (400,) and merged.kv_block_size == 16
    assert merged.kv_cache_usage == pytest.approx((0.2 * 100 + 300) / 400)
    assert merged.num_generation_tokens == 15 and merged.prefix_cache_hits == 32
    assert dict(merged.finished_by_reason) == {"stop": 3, "length": 1}
    assert dict(merged.batch_sizes) == {1: 5, 2: 3}
    assert merged.spec_decode == SpecDecodeTotals(3, 8, 4, (3, 1))


def test_a_replicas_counters_survive_its_restart():
    slot = ReplicaSlot(0)
    slot.snapshot = snapshot(num_running_seqs=3, num_generation_tokens=100,
                             finished_by_reason={"stop": 4})
    before = slot.cumulative_snapshot()
    slot.retire_snapshot()  # the process died
    assert slot.cumulative_snapshot().num_running_seqs == 0  # gauges went with it
    slot.snapshot = snapshot(num_generation_tokens=7, finished_by_reason={"stop": 1})
    after = slot.cumulative_snapshot()
    assert after.num_generation_tokens == 107 >= before.num_generation_tokens
    assert dict(after.finished_by_reason) == {"stop": 5}
    assert counters_only(slot.snapshot).num_kv_blocks == 0


def test_offline_llm_refuses_data_parallelism():
    from pagoda import LLM

    with pytest.raises(ValueError, match="pagoda serve --data-parallel-size"):
        LLM(data_parallel_size=2)

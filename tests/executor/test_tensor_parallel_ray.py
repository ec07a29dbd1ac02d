"""Tensor parallelism on Ray (--distributed-executor-backend ray): a two-node Ray cluster on
this machine (ray.cluster_utils.Cluster: a head and one added node, one CPU each), TP=2
with one rank per node (STRICT_SPREAD) gives TP=1's greedy tokens; a group the cluster
cannot place is refused clearly; nothing outlives the cluster."""

from __future__ import annotations

import time

import pytest

from pagoda import LLM, SamplingParams
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer
from tests.process_tree import wait_until_gone

ray = pytest.importorskip("ray", reason="make test installs Ray (the [ray] extra)")
pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    assert wait_until_gone(b"ray") == set()


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_one_rank_per_node_equals_tp1(two_node_cluster, tmp_path) -> None:
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "qwen3")
    expected = generate(LLM(folder, dtype="float32", max_model_len=256))
    llm = LLM(folder, dtype="float32", max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD")
    try:
        workers = llm.engine.runner.workers
        assert len(set(workers.node_ids)) == 2  # one rank on each node
        assert generate(llm) == expected
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 15  # (Ray frees the placement group asynchronously)
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2  # actors and placement group released


def test_a_group_the_cluster_cannot_place_is_refused(two_node_cluster, tmp_path,
                                                     monkeypatch) -> None:
    from pagoda.executor.parallel import ray_workers

    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT", 3.0)
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "llama")
    with pytest.raises(ValueError, match="cannot place 2 workers"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_PACK")  # one node holds only one CPU

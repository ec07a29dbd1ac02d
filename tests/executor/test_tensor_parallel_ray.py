"""Tensor parallelism on Ray (--distributed-executor-backend ray): a two-node Ray cluster on
this machine (ray.cluster_utils.Cluster: a head and one added node, one CPU each), TP=2
with one rank per node (STRICT_SPREAD) gives TP=1's greedy tokens; a group the cluster
cannot place is refused clearly; nothing outlives the cluster."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer
from tests.ray_cluster import wait_for_free_cpus

ray = pytest.importorskip("ray", reason="make test installs Ray (the [ray] extra)")
pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


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
    assert wait_for_free_cpus(ray, 2) == 2  # actors and placement group released


def test_a_group_the_cluster_cannot_place_is_refused(two_node_cluster, tmp_path,
                                                     monkeypatch) -> None:
    from pagoda.executor.parallel import ray_workers

    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT", 3.0)
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "llama")
    with pytest.raises(ValueError, match="cannot place 2 workers"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_PACK")  # one node holds only one CPU

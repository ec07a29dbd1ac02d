"""Sliding-window layers keep only the window's KV blocks: the layers' grouping and the memory
split (kv_cache_layout.py), and the engine end to end on tiny random Gemma 2 (windowed and
global layers) and Mistral (every layer windowed) checkpoints: generations several times
longer than the window, in chunks, two at a time, match transformers token for token while
the windowed pool stays at a few blocks per sequence."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor.kv_cache_layout import (
    kv_cache_groups,
    kv_capacity_tokens,
    split_kv_blocks,
    window_blocks_needed,
)
from pagoda.executor.loader.model_files import bundled_model_path
from tests.executor.test_model_families import greedy_reference
from tests.executor.tiny_checkpoints import build_checkpoint

WINDOW, BLOCK_SIZE, CHUNK = 8, 4, 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_layers_group_by_window() -> None:
    assert kv_cache_groups([None, None]) == ([None], [0, 0])
    assert kv_cache_groups([8, 8, 8]) == ([8], [0, 0, 0])
    assert kv_cache_groups([4, None, 8, None]) == ([None, 8], [1, 0, 1, 0])
    # a window as long as a sequence may be drops nothing: those layers count as full
    assert kv_cache_groups([4, None, 8, None], max_model_len=8) == ([None, 4], [1, 0, 0, 0])
    assert kv_cache_groups([8, 8], max_model_len=8) == ([None], [0, 0])


def test_memory_split_between_groups() -> None:
    # one group: the budget as it was
    assert split_kv_blocks(100, [None], [4], 10, 1000) == [100]
    # the windowed group gets what it can use; the full group the rest of the memory
    assert split_kv_blocks(100, [None, 8], [1, 3], 10, 1000) == [370, 10]
    assert split_kv_blocks(100, [None, 8], [1, 3], 10, 200) == [200, 10]  # capped at useful
    # short of memory: both groups equal
    assert split_kv_blocks(5, [None, 8], [1, 3], 10, 1000) == [5, 5]
    assert split_kv_blocks(100, [8], [4], 10, 1000) == [10]
    # 4 sequences: 4 x (2 + 2) + a chunk of 2 blocks, below 4 whole sequences of 32 blocks
    assert window_blocks_needed(8, 4, 4, 8, 128) == 18
    assert window_blocks_needed(8, 4, 4, 8, 8) == 8


def test_capacity_of_the_groups() -> None:
    # a full group holds its blocks' tokens; a windowed group any length once it holds a
    # window and a chunk (cdiv(8 - 1 + 8, 4) + 1 = 5 blocks)
    assert kv_capacity_tokens([None], [10], 4, 8, 128) == 40
    assert kv_capacity_tokens([None], [32], 4, 8, 128) == 128
    assert kv_capacity_tokens([8], [5], 4, 8, 128) == 128
    assert kv_capacity_tokens([8], [4], 4, 8, 128) == 16
    assert kv_capacity_tokens([None, 8], [20, 5], 4, 8, 128) == 80


@pytest.mark.parametrize("arch, overrides, windows", [
    ("gemma2", {}, (None, WINDOW)),  # layers 0 and 2 slide, layer 1 is global
    ("mistral", {"sliding_window": WINDOW}, (WINDOW,)),
])
def test_long_generations_keep_only_the_window(arch, overrides, windows, tmp_path) -> None:
    reference = build_checkpoint(arch, str(tmp_path), **overrides)
    llm = LLM(model=str(tmp_path), tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, max_model_len=128, block_size=BLOCK_SIZE,
              max_num_batched_tokens=CHUNK, max_num_seqs=4)
    engine = llm.engine
    snapshot = engine.snapshot()
    assert snapshot.kv_group_windows == windows
    window_pool = snapshot.kv_group_num_blocks[-1]
    assert window_pool == window_blocks_needed(WINDOW, BLOCK_SIZE, 4, CHUNK, 128) == 18
    runner = engine.runner
    assert [runner.kv_caches[i].shape[2] for i in range(len(runner.kv_caches))] == [
        runner.num_blocks_per_group[g] for g in runner.layer_kv_groups]

    snapshots = []
    step = engine.step

    def recording_step():
        outputs = step()
        snapshots.append(engine.snapshot())
        return outputs

    engine.step = recording_step
    prompts = [list(range(3, 23)), [120, 4] * 6]  # 20 and 12 tokens, then 40 generated each
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, 40)[0]

    # Without the freeing the two sequences would need 15 + 13 blocks of the windowed pool
    # (it has 18); with it, each holds its window, its new tokens and a partial block.
    window_used = [s.kv_group_num_blocks[-1] - s.kv_group_num_free_blocks[-1] for s in snapshots]
    bound = 2 * (cdiv(WINDOW, BLOCK_SIZE) + 1) + cdiv(CHUNK, BLOCK_SIZE) + 2
    assert 0 < max(window_used) <= bound < cdiv(60, BLOCK_SIZE) + cdiv(52, BLOCK_SIZE)
    assert snapshots[-1].num_preemptions == 0
    if windows[0] is None:  # the full group holds every block of both sequences
        full_used = [s.kv_group_num_blocks[0] - s.kv_group_num_free_blocks[0] for s in snapshots]
        assert max(full_used) >= cdiv(59, BLOCK_SIZE) + cdiv(51, BLOCK_SIZE) - 1
    assert snapshots[-1].num_free_kv_blocks == snapshots[-1].num_kv_blocks

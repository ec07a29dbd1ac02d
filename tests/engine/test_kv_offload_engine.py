"""The KV tiers end to end on the bundled model (float32, greedy), with the real
KVOffloadWorker: a prefix evicted from a small KV pool comes back from the host tier with
exactly the tokens of an uncached run; the disk tier survives a restart (a new engine on the
same folder reads the blocks back) and is never reused across another KV dtype or block
size, and a corrupt or truncated entry is recomputed; a disk quota too small for any block
serves every request; --preemption-mode swap gives the tokens of recompute, and recomputes
when the host tier is too small."""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow

HOST_BYTES = 64 << 20
PROMPT = ("A returning conversation: the user asked about the history of tea in China, "
          "then about its trade routes, then about how it reached Europe. " * 3)
OTHERS = [f"Other users talk about {topic}, at length, with many details. " * 6
          for topic in ("trains", "owls", "glass", "bees", "maps", "salt")]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(llm: LLM, prompt: str, max_tokens: int = 12) -> list[int]:
    return list(llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def reference(bundled_llm: LLM) -> list[int]:
    """PROMPT's tokens from an engine without tiers, prefix caching off."""
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    out = tokens(llm, PROMPT)
    del llm
    gc.collect()
    return out


def small_pool(**kwargs) -> LLM:
    """16 blocks of 16 tokens: the other prompts evict PROMPT's blocks."""
    return LLM(dtype="float32", num_kv_blocks=16, max_model_len=256, **kwargs)


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier(reference) -> None:
    llm = small_pool(kv_offload_memory=HOST_BYTES)
    assert tokens(llm, PROMPT) == reference
    for other in OTHERS:
        tokens(llm, other, 2)
    kv_offload = llm.engine.snapshot().kv_offload
    assert kv_offload.num_keys > 0 and kv_offload.stats["host_bytes_written"] > 0
    assert kv_offload.hit_tokens == 0
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    again = llm.generate(PROMPT, greedy(), use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == reference
    kv_offload = llm.engine.snapshot().kv_offload
    assert kv_offload.hit_tokens >= 16 * ((len(prompt_ids) - 1) // 16) - 16
    assert kv_offload.loaded_blocks * 16 == kv_offload.hit_tokens and kv_offload.failed_loads == 0
    assert kv_offload.stats["host_hits"] == kv_offload.loaded_blocks
    assert again.num_cached_tokens >= kv_offload.hit_tokens
    llm.engine.step()
    assert llm.engine.snapshot().num_free_kv_blocks == 16


def test_an_8_bit_cache_comes_back_from_the_host_tier_unchanged() -> None:
    """The 8-bit cache's codes and scales travel together: the tier hit gives the tokens
    of an uncached run on the same 8-bit cache."""
    plain = LLM(dtype="float32", num_kv_blocks=64, max_model_len=512, kv_cache_dtype="int8",
                enable_prefix_caching=False)
    expected = tokens(plain, PROMPT)
    del plain
    gc.collect()
    llm = small_pool(kv_offload_memory=HOST_BYTES, kv_cache_dtype="int8")
    assert tokens(llm, PROMPT) == expected
    for other in OTHERS:
        tokens(llm, other, 2)
    assert tokens(llm, PROMPT) == expected
    kv_offload = llm.engine.snapshot().kv_offload
    assert kv_offload.hit_tokens > 0 and kv_offload.loaded_blocks > 0 and kv_offload.failed_loads == 0


def test_the_disk_tier_survives_a_restart_and_never_crosses_a_mismatch(reference,
                                                                        tmp_path) -> None:
    folder = str(tmp_path / "kv")
    first = small_pool(kv_offload_dir=folder)
    assert tokens(first, PROMPT) == reference
    first.engine.shutdown()  # a graceful shutdown flushes the pool's prefix blocks to disk
    del first
    gc.collect()

    second = small_pool(kv_offload_dir=folder)
    kv_offload = second.engine.snapshot().kv_offload
    assert kv_offload.num_keys > 0  # the disk tier's entries seed the index
    assert tokens(second, PROMPT) == reference
    kv_offload = second.engine.snapshot().kv_offload
    assert kv_offload.hit_tokens > 0 and kv_offload.failed_loads == 0
    assert kv_offload.stats["disk_hits"] == kv_offload.loaded_blocks > 0
    assert kv_offload.stats["disk_bytes_read"] > 0
    del second
    gc.collect()

    # a truncated file is dropped at start, a flipped byte at its read: recomputed, never used
    files = sorted(glob.glob(os.path.join(folder, "*", "*.kv")))
    assert len(files) >= 2
    with open(files[0], "r+b") as f:
        f.truncate(os.path.getsize(files[0]) // 2)
    for name in files[1:]:
        with open(name, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    third = small_pool(kv_offload_dir=folder)
    assert tokens(third, PROMPT) == reference
    kv_offload = third.engine.snapshot().kv_offload
    assert kv_offload.stats["corrupt_entries"] >= 2 and kv_offload.loaded_blocks == 0
    del third
    gc.collect()

    for mismatch in ({"kv_cache_dtype": "int8"}, {"block_size": 32}):
        other = LLM(dtype="float32", num_kv_blocks=16, max_model_len=256,
                    kv_offload_dir=folder, **mismatch)
        assert other.engine.snapshot().kv_offload.num_keys == 0, mismatch
        tokens(other, PROMPT)
        kv_offload = other.engine.snapshot().kv_offload
        assert kv_offload.hit_tokens == 0 and kv_offload.stats.get("disk_hits", 0) == 0, mismatch
        del other
        gc.collect()


def test_a_disk_tier_too_small_for_anything_serves_every_request(reference, tmp_path) -> None:
    llm = small_pool(kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_bytes=1000)
    assert tokens(llm, PROMPT) == reference
    for other in OTHERS:
        tokens(llm, other, 2)
    assert tokens(llm, PROMPT) == reference  # (computed again: nothing fit on disk)
    kv_offload = llm.engine.snapshot().kv_offload
    assert kv_offload.num_keys == 0 and kv_offload.loaded_blocks == 0
    llm.engine.shutdown()  # the flush within the quota: nothing, and no error


def varied_prompts() -> list[str]:
    topics = ["the moon", "bread", "rivers", "a cat", "chess", "winter", "volcanoes",
              "trains", "music", "honey"]
    return [f"Tell me about {t}. " + "Please be precise. " * (i % 7) * 3
            for i, t in enumerate(topics)]


@pytest.fixture(scope="module")
def preemption_reference(bundled_llm: LLM) -> list[list[int]]:
    outputs = bundled_llm.generate(varied_prompts(), greedy(40), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_swap_preemption_gives_the_tokens_of_recompute(preemption_reference) -> None:
    # 12 blocks of 16 tokens: far too few for 10 requests of up to ~150 tokens at once.
    llm = LLM(dtype="float32", num_kv_blocks=12, max_model_len=192,
              kv_offload_memory=HOST_BYTES, preemption_mode="swap")
    outputs = llm.generate(varied_prompts(), greedy(40), use_tqdm=False)
    snapshot = llm.engine.snapshot()
    assert snapshot.num_preemptions > 0
    kv_offload = snapshot.kv_offload
    assert kv_offload.swapped_out_blocks > 0 and kv_offload.swap_fallbacks == 0
    assert kv_offload.swapped_in_blocks == kv_offload.swapped_out_blocks and kv_offload.swap_bytes == 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == preemption_reference


def test_swap_falls_back_to_recompute_when_the_host_tier_is_too_small(
        preemption_reference) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=12, max_model_len=192,
              kv_offload_memory=1000, preemption_mode="swap")
    outputs = llm.generate(varied_prompts(), greedy(40), use_tqdm=False)
    snapshot = llm.engine.snapshot()
    assert snapshot.num_preemptions > 0
    assert snapshot.kv_offload.swap_fallbacks == snapshot.num_preemptions
    assert snapshot.kv_offload.swapped_out_blocks == 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == preemption_reference


def test_pagoda_generate_leaves_its_prompt_on_the_disk_tier(tmp_path) -> None:
    folder = tmp_path / "kv"
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "generate", "--max-tokens", "2", "--kv-offload-dir",
         str(folder), "Tell me about the history of tea, its trade routes and its culture."],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert glob.glob(os.path.join(folder, "*", "*.kv"))  # flushed at its end

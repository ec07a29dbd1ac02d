"""The engine on the bundled model: batching, prefix caching, preemption, leaks, sampling."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.loop.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

TOPICS = [
    "the moon", "bread", "rivers", "a cat", "chess", "winter", "volcanoes", "trains",
    "music", "honey", "glass", "the ocean", "bees", "clocks", "maps", "tea",
    "snow", "bridges", "owls", "paper", "salt", "stars", "rain", "gardens",
]


def varied_prompts() -> list[str]:
    # Lengths vary from a few tokens to ~100, so batches mix prefills of many sizes.
    return [f"Tell me about {t}. " + "Please be precise. " * (i % 7) * 3 for i, t in enumerate(TOPICS)]


def assert_idle(engine: LLMEngine) -> None:
    """No request state anywhere and every KV block free."""
    assert not engine.has_unfinished_requests()
    snapshot = engine.snapshot()
    assert not snapshot.has_unfinished_requests and snapshot.num_tracked_requests == 0
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks
    assert snapshot.kv_cache_usage == 0.0
    assert len(engine.runner.generators) == 0 and engine.runner.input_batch.requests == {}


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_batch_invariance(bundled_llm: LLM) -> None:
    prompts = varied_prompts()
    together = bundled_llm.generate(prompts, greedy(), use_tqdm=False)
    assert max(bundled_llm.engine.snapshot().batch_sizes) > 1
    for prompt, batched in zip(prompts, together):
        alone = bundled_llm.generate(prompt, greedy(), use_tqdm=False)[0]
        assert batched.outputs[0].token_ids == alone.outputs[0].token_ids, prompt
    # the engine sweeps its own state after the run (finished_request_ids travel one step)
    bundled_llm.engine.step()
    assert_idle(bundled_llm.engine)


def test_one_forward_per_step(bundled_llm: LLM, monkeypatch) -> None:
    """64 prompts: each engine step is exactly one model forward over the whole batch,
    whichever executor runs it (the eager model, or the whole-stack C decode step), and
    the engine counts each step under the executor that ran it."""
    runner = bundled_llm.engine.runner
    calls, forward = [], runner._forward

    def counted(input_ids, *args):
        calls.append(len(input_ids))
        return forward(input_ids, *args)

    monkeypatch.setattr(runner, "_forward", counted)
    before = bundled_llm.engine.snapshot()
    outputs = bundled_llm.generate([f"Count to {i}." for i in range(64)], greedy(8), use_tqdm=False)
    after = bundled_llm.engine.snapshot()
    assert len(outputs) == 64 and all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert len(calls) == after.num_steps - before.num_steps
    assert len(calls) == sum(after.steps_by_executor.values()) - sum(
        before.steps_by_executor.values())
    assert len(calls) < 64  # batched, not one call per request
    assert max(calls) > 64  # a step carried many requests' tokens


def test_prefix_caching_reuses_shared_system_prompt(bundled_llm: LLM) -> None:
    engine = bundled_llm.engine
    system = "You are a careful assistant who answers in exactly one sentence. " * 12
    prompts = [system + f"Question {i}: name a fruit." for i in range(6)]
    engine.reset_prefix_cache()
    before = engine.snapshot().num_computed_prompt_tokens
    first = bundled_llm.generate(prompts, greedy(12), use_tqdm=False)
    computed_first = engine.snapshot().num_computed_prompt_tokens - before
    before = engine.snapshot().num_computed_prompt_tokens
    second = bundled_llm.generate(prompts, greedy(12), use_tqdm=False)
    computed_second = engine.snapshot().num_computed_prompt_tokens - before
    total_prompt = sum(len(o.prompt_token_ids) for o in first)
    # Within the first run the shared system prompt is computed once, not six times.
    assert computed_first < total_prompt / 2
    # The second time only each prompt's last (partial) block is recomputed.
    assert computed_second <= len(prompts) * engine.snapshot().kv_block_size
    assert all(o.num_cached_tokens > 0 for o in second)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_caching_off_computes_everything(bundled_gguf) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    prompt = "Shared words are shared. " * 20
    before = llm.engine.snapshot().num_computed_prompt_tokens
    outs = llm.generate([prompt, prompt], greedy(4), use_tqdm=False)
    assert llm.engine.snapshot().num_computed_prompt_tokens - before == 2 * len(outs[0].prompt_token_ids)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_preemption_keeps_outputs_identical(bundled_llm: LLM) -> None:
    prompts = varied_prompts()[:10]
    reference = bundled_llm.generate(prompts, greedy(40), use_tqdm=False)
    # 12 blocks of 16 tokens: far too few for 10 requests of up to ~150 tokens at once.
    small = LLM(dtype="float32", num_kv_blocks=12, max_model_len=192)
    constrained = small.generate(prompts, greedy(40), use_tqdm=False)
    assert small.engine.snapshot().num_preemptions > 0
    for ref, got in zip(reference, constrained):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    small.engine.step()
    assert_idle(small.engine)


def test_abort_mid_generation_frees_everything(bundled_llm: LLM) -> None:
    engine = bundled_llm.engine
    for i in range(5):
        engine.add_request(f"abort-{i}", f"Write a long story number {i}.", greedy(200))
    for _ in range(6):
        engine.step()
    assert engine.snapshot().num_free_kv_blocks < engine.snapshot().num_kv_blocks
    engine.abort_request([f"abort-{i}" for i in range(5)])
    engine.step()  # delivers finished ids to the runner, which drops their generators
    assert_idle(engine)


def test_priority_policy_runs_urgent_first(bundled_gguf) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=1,
              scheduling_policy="priority")
    outputs = llm.generate(["a", "b", "c"], greedy(2), use_tqdm=False, priority=[5, 0, 9])
    times = [o.metrics.first_token_time for o in outputs]
    assert times[1] < times[0] < times[2]


def test_prompt_too_long_is_rejected_with_numbers(bundled_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt is 3000 tokens.*2048"):
        bundled_llm.generate([[1] * 3000], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        bundled_llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        bundled_llm.generate([[10**7]], greedy(), use_tqdm=False)
    assert_idle(bundled_llm.engine)


# ---- sampling parameters through the whole engine ---------------------------------------


def test_seed_reproduces_whatever_the_batch(bundled_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True)
    alone = bundled_llm.generate("Invent a name for a ship.", params, use_tqdm=False)[0]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = bundled_llm.generate(
        ["Say hi.", "Invent a name for a ship.", "Count."], [noise, params, noise], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True)
    different = bundled_llm.generate("Invent a name for a ship.", other, use_tqdm=False)[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_top_k_1_equals_greedy(bundled_llm: LLM) -> None:
    prompt = "Describe a sunrise."
    expected = bundled_llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)
    assert bundled_llm.generate(prompt, top1, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_stop_string_truncates_text(bundled_llm: LLM) -> None:
    full = bundled_llm.chat([{"role": "user", "content": "Count from 1 to 10 with commas."}],
                            greedy(40), use_tqdm=False)[0].outputs[0].text
    assert "4" in full
    stop_at = full[full.index("4"):full.index("4") + 1]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_at])
    out = bundled_llm.chat([{"role": "user", "content": "Count from 1 to 10 with commas."}],
                           params, use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop_at)]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    params.include_stop_str_in_output = True
    out = bundled_llm.chat([{"role": "user", "content": "Count from 1 to 10 with commas."}],
                           params, use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop_at) + len(stop_at)]


def test_stop_token_ids_and_max_tokens(bundled_llm: LLM) -> None:
    base = bundled_llm.generate("The alphabet:", greedy(10), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id])
    out = bundled_llm.generate("The alphabet:", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_and_min_tokens_delays_it(bundled_llm: LLM) -> None:
    conv = [{"role": "user", "content": "Reply with just the word yes."}]
    short = bundled_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    out = short.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in bundled_llm.engine.eos_token_ids
    n = len(out.token_ids)
    longer = bundled_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=n + 5),
                              use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 5


def test_logit_bias_forces_a_token(bundled_llm: LLM) -> None:
    token = bundled_llm.get_tokenizer().encode(" banana")[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={token: 100.0}, ignore_eos=True)
    out = bundled_llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [token] * 5


def test_logprobs_equal_log_softmax_of_model_logits(bundled_llm: LLM) -> None:
    engine = bundled_llm.engine
    prompt_ids = engine.tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = bundled_llm.generate([prompt_ids], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    all_ids = prompt_ids + completion.token_ids
    logits = engine.runner.prompt_logits([all_ids])[0]
    reference = torch.log_softmax(logits, dim=-1)
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt_ids) - 1 + step]
        assert next(iter(position)) == token
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert position[token].rank == 1  # greedy picks the most likely token
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(position)
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)), abs=1e-5
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        token = prompt_ids[i]
        expected = reference[i - 1][token].item()
        assert out.prompt_logprobs[i][token].logprob == pytest.approx(expected, abs=1e-4)


def test_penalties_change_output(bundled_llm: LLM) -> None:
    prompt = "Repeat after me: go go go go go go go go"
    plain = bundled_llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    penalised = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=1.0, presence_penalty=1.0)
    changed = bundled_llm.generate(prompt, penalised, use_tqdm=False)[0].outputs[0].token_ids
    assert changed != plain
    assert len(set(changed)) > len(set(plain))  # penalties push towards new tokens


def test_n_completions_share_prompt_blocks(bundled_llm: LLM) -> None:
    engine = bundled_llm.engine
    engine.reset_prefix_cache()
    prompt = "Write one word about autumn. " * 8
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    before = engine.snapshot().num_computed_prompt_tokens
    out = bundled_llm.generate(prompt, params, use_tqdm=False)[0]
    computed = engine.snapshot().num_computed_prompt_tokens - before
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each choice has its own seed
    num_prompt = len(out.prompt_token_ids)
    # The prompt's full blocks are computed once and shared by the three choices.
    assert computed <= num_prompt + 2 * engine.snapshot().kv_block_size
    again = bundled_llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_the_start_up_heap_is_out_of_the_collectors_sight(bundled_llm: LLM) -> None:
    """engine/loop/builder.py freezes what start-up built: the model's modules are not among the
    objects a collection scans, so a full collection in a decode step costs ~0 instead of
    scanning hundreds of thousands of objects (a 1B model: ~110 ms unfrozen)."""
    import gc

    assert gc.get_freeze_count() > 0
    model = bundled_llm.engine.runner.model
    tracked = gc.get_objects()
    assert not any(obj is model for obj in tracked)
    assert all(obj is not layer for obj in tracked for layer in model.model.layers[:2])


def test_a_frozen_cycle_dropped_since_is_collected_at_the_next_freeze() -> None:
    """An engine dropped after its build froze it (its cycles in the permanent generation)
    is collected by the next build or model release (builder.collect_and_freeze)."""
    import gc
    import weakref

    from pagoda.engine.loop.builder import collect_and_freeze

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    alive = weakref.ref(node)
    gc.freeze()
    del node
    gc.collect()
    assert alive() is not None  # frozen: out of the collector's sight
    collect_and_freeze()
    assert alive() is None

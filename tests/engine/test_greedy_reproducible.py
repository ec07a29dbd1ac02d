"""Temperature 0 is reproducible in the default mode: the same greedy request gives the same
tokens on a cold cache, on a prefix-cache hit (the rest of the prompt computed in other
shapes: a long prompt's cold prefill multiplies by dequantized weights, the uncached tail
of a hit by the packed kernels), in a batch with other requests, and chunked.

Issue 31 saw bf16 (then the default on AVX-512 BF16 CPUs) answer "...la femme, la femme,"
first and "...la femme au martyre" on the next calls: the shapes changed the rounding, and a
bf16 near-tie flipped. In float32 the same differences move logits by ~1e-5, far below the
bundled model's margins on these prompts; this test holds the engine to that, through the
paths that differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = sorted((Path(__file__).parent.parent / "data" / "fidelity").glob("*.txt"))
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def prompts(llm: LLM) -> list[list[int]]:
    """Two prompts longer than the dequantizing threshold (128 rows), one short."""
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(path.read_text())[:n] for path, n in zip(TEXTS, (300, 180, 40))]


def tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_identical_greedy_requests_give_identical_outputs(bundled_llm: LLM) -> None:
    llm = bundled_llm
    llm.engine.reset_prefix_cache()
    ids = prompts(llm)
    cold = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ids]
    hits_before = llm.engine.snapshot().prefix_cache_hits
    cached = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ids]
    assert llm.engine.snapshot().prefix_cache_hits - hits_before >= 256  # the long prompts
    batched = tokens(llm.generate(ids + [p[:20] for p in ids], GREEDY, use_tqdm=False))[:3]
    assert cached == cold
    assert batched == cold


def test_the_readme_question_repeats_its_answer(bundled_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32)
    bundled_llm.engine.reset_prefix_cache()
    answers = [bundled_llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].text
               for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert "Paris" in answers[0]


def test_chunked_prefill_gives_the_same_greedy_tokens(bundled_llm: LLM) -> None:
    chunked = LLM(dtype="float32", max_num_batched_tokens=64, kv_cache_memory=128 << 20,
                  max_model_len=2048)
    ids = prompts(chunked)
    assert tokens(chunked.generate(ids, GREEDY, use_tqdm=False)) == \
        tokens(bundled_llm.generate(ids, GREEDY, use_tqdm=False))

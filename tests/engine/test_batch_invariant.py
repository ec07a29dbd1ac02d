"""--deterministic (executor/batch_invariant.py): an identical request gives bit-identical
logprobs, and so identical tokens, on a cold cache, on a prefix-cache hit, in a batch with
other requests and with its prompt chunked; through packed GGUF weights (the bundled model),
float weights and Pagoda-quantized ones. What the mode does not cover is refused with the
reason. (The default mode differs in the last bits on these same runs: that is why the mode
exists; test_greedy_reproducible.py holds the default mode's tokens.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from tests.entrypoints.test_cli import assert_one_line_error, run_cli
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer

pytestmark = pytest.mark.slow  # (make test-fast skips it)

TEXTS = sorted((Path(__file__).parent.parent / "data" / "fidelity").glob("*.txt"))
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


def fingerprint(output) -> list:
    """Each generated token with the exact float logprobs of its top candidates."""
    completion = output.outputs[0]
    return [(token, sorted((t, p.logprob) for t, p in position.items()))
            for token, position in zip(completion.token_ids, completion.logprobs)]


def every_way(llm: LLM, chunked: LLM, prompts: list[list[int]]) -> None:
    """Cold (one at a time, empty prefix cache), then cache hits, then one batch with other
    requests of other lengths, then on `chunked` (the same model, small step budget):
    every fingerprint equal."""
    llm.engine.reset_prefix_cache()
    cold = [fingerprint(llm.generate([p], GREEDY, use_tqdm=False)[0]) for p in prompts]
    hits_before = llm.engine.snapshot().prefix_cache_hits
    cached = [fingerprint(llm.generate([p], GREEDY, use_tqdm=False)[0]) for p in prompts]
    assert llm.engine.snapshot().prefix_cache_hits > hits_before
    others = [p[: len(p) // 3 + 1] + [p[0]] for p in prompts]
    batched = [fingerprint(o) for o in llm.generate(others + prompts, GREEDY, use_tqdm=False)]
    chunks = [fingerprint(o) for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert cached == cold
    assert batched[len(others):] == cold
    assert chunks == cold


@pytest.mark.slow
def test_the_bundled_model_repeats_itself_bit_for_bit() -> None:
    llm = LLM(deterministic=True, kv_cache_memory=64 << 20, max_model_len=1024)
    chunked = LLM(deterministic=True, kv_cache_memory=64 << 20, max_model_len=1024,
                  max_num_batched_tokens=48)
    tokenizer = llm.get_tokenizer()
    # past the default mode's dequantize threshold (128 rows), under it, and one block
    prompts = [tokenizer.encode(path.read_text())[:n] for path, n in zip(TEXTS, (200, 70, 16))]
    every_way(llm, chunked, prompts)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_float_and_quantized_weights_repeat_themselves_bit_for_bit(quantization, tmp_path) -> None:
    """A tiny random Llama (untied float head: the row-at-a-time linear; int8: the row-wise
    quantized kernel), head_dim 32 for the attention kernel."""
    folder = build_checkpoint_with_bundled_tokenizer(
        str(tmp_path), "llama", num_attention_heads=2, num_key_value_heads=1)
    options = {"model": folder, "deterministic": True, "quantization": quantization,
               "block_size": 4, "kv_cache_memory": 4 << 20, "max_model_len": 256}
    prompts = [list(range(3, 60)), [120, 4] * 9, [7, 8, 9, 10, 11]]
    every_way(LLM(**options), LLM(**options, max_num_batched_tokens=16), prompts)


def test_what_the_mode_does_not_cover_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="float32 activations"):
        LLM(deterministic=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 KV cache"):
        LLM(deterministic=True, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="eager"):
        LLM(deterministic=True, compile=True)
    folder = build_checkpoint_with_bundled_tokenizer(str(tmp_path), "gemma3")
    with pytest.raises(ValueError, match="Llama family.*GemmaDecoderLayer"):
        LLM(model=folder, deterministic=True, kv_cache_memory=4 << 20, max_model_len=256)


def test_the_cli_refuses_a_mode_it_does_not_cover_in_one_line() -> None:
    assert_one_line_error(run_cli("generate", "--deterministic", "--dtype", "bfloat16", "hi"),
                          "deterministic")

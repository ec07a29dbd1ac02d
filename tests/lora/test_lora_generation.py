"""LoRA adapters end to end through LLM(enable_lora=True): greedy output of each adapter
(PEFT, made by peft on tiny random Llama / Qwen3 checkpoints) equals transformers + peft's
merged model token for token in float32; a batch mixing three adapters and the base model
equals each run alone; over an int8 base an adapter still acts and tracks the float run;
tensor parallelism (TP=2) with adapters equals TP=1."""

from __future__ import annotations

import shutil

import pytest

from pagoda import LLM, SamplingParams
from pagoda.lora.adapter_files import LoRAAdapterError
from pagoda.lora.request import LoRARequest
from tests.executor.tiny_checkpoints import build_checkpoint, bundled_tokenizer
from tests.lora.lora_models import ADAPTERS, greedy_reference, make_adapter

PROMPTS = [list(range(3, 30)), [120, 4] * 7, [7, 8, 9]]
NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def engine(folder: str, **options) -> LLM:
    from pagoda.executor.loader.model_files import bundled_model_path

    return LLM(model=folder, tokenizer=bundled_model_path(), dtype="float32",
               max_model_len=128, block_size=4, kv_cache_memory=1 << 21,
               max_num_batched_tokens=16, enable_lora=True, seed=0, **options)


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    """(base folder, transformers base, {kind: (LoRARequest, merged reference)})."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = build_checkpoint(arch, str(root / "base"))
    adapters = {}
    for seed, kind in enumerate(ADAPTERS, start=1):
        folder = str(root / kind)
        merged = make_adapter(base, folder, kind, seed)
        adapters[kind] = (LoRARequest(kind, seed, folder), merged)
    return str(root / "base"), base, adapters


def test_each_adapter_equals_the_peft_merged_model(setup) -> None:
    folder, base, adapters = setup
    llm = engine(folder, max_loras=2)
    base_tokens = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert base_tokens == [greedy_reference(base, p, NUM_TOKENS) for p in PROMPTS]
    for kind, (lora, merged) in adapters.items():
        ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
        expected = [greedy_reference(merged, p, NUM_TOKENS) for p in PROMPTS]
        assert ours == expected, kind
        assert ours != base_tokens, kind  # the adapter acted


def test_a_mixed_batch_equals_each_alone(setup) -> None:
    """Three adapters and the base in one batch (and each prompt under each), with
    max_loras=3: steps hold rows of all of them, chunked prefill beside decodes."""
    folder, _, adapters = setup
    llm = engine(folder, max_loras=3, max_cpu_loras=3)
    chosen = [adapters[k][0] for k in ("all", "qv", "patterns")] + [None]
    prompts = [p for p in PROMPTS for _ in chosen]
    loras = [lora for _ in PROMPTS for lora in chosen]
    mixed = tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    for prompt, lora, ours in zip(prompts, loras, mixed):
        alone = tokens(llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False))[0]
        assert ours == alone, (lora, prompt)
    assert len({tuple(t) for t in mixed[:4]}) > 1  # the adapters differ from one another


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_base_with_a_float_adapter(setup, method) -> None:
    """QLoRA-style: the adapter over an int8 / int4 base still acts (every prompt's first
    token differs from that base's alone) and tracks the float run: most tokens the same
    (int8: two thirds and every prompt's first; int4, whose weights are ~15% off, half)."""
    folder, _, adapters = setup
    lora = adapters["all"][0]
    float_tokens = tokens(engine(folder).generate(PROMPTS, GREEDY, lora_request=lora,
                                                  use_tqdm=False))
    llm = engine(folder, quantization=method)
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
    base = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(a[0] != b[0] for a, b in zip(ours, base))
    same = sum(a == f for o, fl in zip(ours, float_tokens) for a, f in zip(o, fl))
    if method == "int8":
        assert all(a[0] == f[0] for a, f in zip(ours, float_tokens))
        assert same >= 2 * len(PROMPTS) * NUM_TOKENS // 3, (ours, float_tokens)
    else:
        assert same >= len(PROMPTS) * NUM_TOKENS // 2, (ours, float_tokens)


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_one_process(setup) -> None:
    """TP=2 (two worker processes, each with its share of the base and of the adapters:
    A's columns on o/down, B's rows on qkv/gate_up) gives TP=1's tokens, adapters mixed
    with the base in one batch."""
    folder, _, adapters = setup
    loras = [adapters["all"][0], None, adapters["patterns"][0]]
    single = tokens(engine(folder, max_loras=2).generate(PROMPTS, GREEDY, lora_request=loras,
                                                         use_tqdm=False))
    parallel = engine(folder, max_loras=2, tensor_parallel_size=2)
    try:
        assert tokens(parallel.generate(PROMPTS, GREEDY, lora_request=loras,
                                        use_tqdm=False)) == single
    finally:
        parallel.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_speculative_decoding_verifies_with_the_adapter(setup, method, tmp_path) -> None:
    """The draft (n-grams, or the base model itself as a draft model) proposes without
    adapters; the target's verification runs each request's adapter: greedy tokens equal
    the plain run's, adapters and the base mixed."""
    folder, _, adapters = setup
    loras = [adapters["all"][0], None, adapters["qv"][0]]
    plain = tokens(engine(folder, max_loras=2).generate(PROMPTS, GREEDY, lora_request=loras,
                                                        use_tqdm=False))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":  # the base's weights, with a tokenizer of their own
        spec["model"] = str(tmp_path / "draft")
        shutil.copytree(folder, spec["model"])
        bundled_tokenizer().save_pretrained(spec["model"])
    llm = engine(folder, max_loras=2, speculative_config=spec)
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)) == plain


def test_compile_with_lora_is_refused() -> None:
    from pagoda.config import EngineConfig

    with pytest.raises(ValueError, match="compile and enable_lora"):
        EngineConfig.from_kwargs(compile=True, enable_lora=True)


def test_an_adapter_removed_while_its_requests_run_is_freed_after(setup) -> None:
    """engine.remove_lora while requests of the adapter run: they finish with the tokens
    they would have had; then the runner frees the adapter's weights (removed_lora_ids)."""
    folder, _, adapters = setup
    lora = adapters["all"][0]
    llm = engine(folder, max_loras=2)
    expected = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
    manager = llm.engine.runner.lora
    assert lora.lora_int_id in manager.model_lora.loaded
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"r{i}", prompt, GREEDY, lora_request=lora)
    llm.engine.step()
    assert llm.engine.remove_lora(lora.lora_int_id)
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if len(finished) < len(PROMPTS):
            assert lora.lora_int_id in manager.model_lora.loaded
    llm.engine.step()  # (the step that tells the runner, if the last one did not)
    assert [finished[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert lora.lora_int_id not in manager.model_lora.loaded
    assert manager.loaded_ids == [] and all(not held for layer in manager.model_lora.adapters
                                            for held in layer)


def test_an_adapter_that_cannot_load_fails_its_request_alone(setup, tmp_path) -> None:
    """A path with no adapter met by the runner (engine.add_request: LLM.generate checks
    the files up front): that request fails with the reason at its first step; the other
    request of the batch, and later ones, run."""
    folder, _, adapters = setup
    llm = engine(folder, max_loras=2)
    bad = LoRARequest("missing", 99, str(tmp_path / "nothing-here"))
    good = adapters["qv"][0]
    with pytest.raises(LoRAAdapterError, match="nothing-here"):  # the offline API's check
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[bad, good], use_tqdm=False)
    expected = tokens(engine(folder).generate(PROMPTS[1:2], GREEDY, lora_request=good,
                                              use_tqdm=False))
    llm.engine.add_request("bad", PROMPTS[0], GREEDY, lora_request=bad)
    llm.engine.add_request("good", PROMPTS[1], GREEDY, lora_request=good)
    finished, failed = {}, {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = out
        failed.update(llm.engine.take_failed_requests())
    assert set(failed) == {"bad"} and set(finished) == {"good"}
    assert "'missing' failed to load" in failed["bad"] and "nothing-here" in failed["bad"]
    assert tokens([finished["good"]]) == expected
    assert tokens(llm.generate(PROMPTS[1:2], GREEDY, lora_request=good,
                               use_tqdm=False)) == expected


@pytest.mark.slow
def test_a_gguf_adapter_gives_its_peft_source_s_tokens(setup, tmp_path) -> None:
    """The same adapter converted by llama.cpp's convert_lora_to_gguf.py (f32): the same
    greedy tokens as the PEFT folder, the two in one batch. (One alpha for every module: a
    GGUF adapter holds one `adapter.lora.alpha`, so the converter drops alpha_pattern.)"""
    from tests import llama_cpp_tools

    folder, _, adapters = setup
    peft = adapters["all"][0]
    path = str(tmp_path / "adapter.gguf")
    assert llama_cpp_tools.convert_lora([(peft.lora_path, folder, "f32", path)]) == {}
    gguf = LoRARequest("all-gguf", 50, path)
    llm = engine(folder, max_loras=2)
    ours = tokens(llm.generate(PROMPTS * 2, GREEDY, lora_request=[peft] * 3 + [gguf] * 3,
                               use_tqdm=False))
    assert ours[3:] == ours[:3]
    assert ours[:3] == [greedy_reference(adapters["all"][1], p, NUM_TOKENS)
                        for p in PROMPTS]


def test_deterministic_mode_keeps_adapter_rows_bit_identical(tmp_path) -> None:
    """--deterministic with adapters: a request's logprobs are the same bits alone and in a
    batch mixing adapters and the base (the deltas computed a row at a time). (Heads of 32:
    the mode's attention kernel takes no smaller.)"""
    folder = str(tmp_path / "base")
    base = build_checkpoint("llama", folder, head_dim=32)
    loras = [LoRARequest(kind, i, str(tmp_path / kind))
             for i, kind in enumerate(("all", "rslora"), start=1)]
    for lora in loras:
        make_adapter(base, lora.lora_path, lora.lora_name, lora.lora_int_id)
    llm = engine(folder, max_loras=2, deterministic=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    loras = [loras[0], None, loras[1]]

    def logprobs(outputs):
        return [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs]

    mixed = logprobs(llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False))
    for prompt, lora, ours in zip(PROMPTS, loras, mixed):
        assert logprobs(llm.generate([prompt], params, lora_request=lora,
                                     use_tqdm=False))[0] == ours

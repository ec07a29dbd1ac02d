"""LoRA adapters through the engine's other paths (issue 35): a KV pool so small that
requests are preempted and recomputed, with chunked prefill, keeps every adapter's greedy
tokens; n > 1 samples each child with the parent's adapter; structured output constrains an
adapter's tokens as the base's. Tiny random Llama, peft-made adapters, float32."""

from __future__ import annotations

import re

import pytest

from pagoda import LLM, SamplingParams
from pagoda.lora.request import LoRARequest
from pagoda.structured_outputs import StructuredOutputsParams
from tests.executor.tiny_checkpoints import build_checkpoint, bundled_tokenizer
from tests.lora.lora_models import make_adapter

PROMPTS = [list(range(3, 40)), [120, 4] * 12, list(range(50, 75))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_paths")
    # the bundled tokenizer's whole vocabulary: structured output's grammar needs it
    base = build_checkpoint("llama", str(root / "base"), vocab_size=len(bundled_tokenizer()))
    loras = []
    for seed, kind in enumerate(("all", "qv"), start=1):
        make_adapter(base, str(root / kind), kind, seed)
        loras.append(LoRARequest(kind, seed, str(root / kind)))
    return str(root / "base"), loras


def engine(folder: str, **options) -> LLM:
    from pagoda.executor.loader.model_files import bundled_model_path

    return LLM(model=folder, tokenizer=bundled_model_path(), dtype="float32",
               max_model_len=128, block_size=4, enable_lora=True, max_loras=2,
               max_num_batched_tokens=16, seed=0, **options)


def tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def test_preemption_and_chunked_prefill_keep_each_adapter_s_tokens(setup) -> None:
    folder, loras = setup
    chosen = [*loras, None]
    prompts = [p for p in PROMPTS for _ in chosen]
    requests = [lora for _ in PROMPTS for lora in chosen]
    roomy = engine(folder, kv_cache_memory=1 << 22)
    expected = tokens(roomy.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False))
    del roomy
    # 40 blocks of 4 tokens: nine requests of ~60 tokens cannot all stay
    tight = engine(folder, num_kv_blocks=40)
    ours = tokens(tight.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False))
    assert tight.llm_engine.snapshot().num_preemptions > 0
    assert ours == expected
    assert expected[0] != expected[2]  # (the adapter acted)


def test_n_children_run_the_parent_s_adapter(setup) -> None:
    folder, loras = setup
    llm = engine(folder, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=12, ignore_eos=True)
    for lora in (*loras, None):
        together = tokens(llm.generate([PROMPTS[0]], params, lora_request=lora,
                                       use_tqdm=False))[0]
        assert len(together) == 3 and len({tuple(t) for t in together}) > 1
        greedy_child = tokens(llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0, n=2, max_tokens=12, ignore_eos=True),
            lora_request=lora, use_tqdm=False))[0]
        alone = tokens(llm.generate([PROMPTS[0]], SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True), lora_request=lora,
            use_tqdm=False))[0][0]
        assert greedy_child == [alone, alone], lora


def test_structured_output_holds_under_an_adapter(setup) -> None:
    """A regex and a choice constrain each adapter's greedy tokens (a random model left
    alone would write neither)."""
    folder, loras = setup
    llm = engine(folder, kv_cache_memory=1 << 22)
    pattern = SamplingParams(temperature=0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(regex=r"(yes|no)-[0-9]{3}")))
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    for lora in (*loras, None):
        text = llm.generate([PROMPTS[1]], pattern, lora_request=lora,
                            use_tqdm=False)[0].outputs[0].text
        assert re.fullmatch(r"(yes|no)-[0-9]{3}", text), (lora, text)
        text = llm.generate([PROMPTS[2]], choice, lora_request=lora,
                            use_tqdm=False)[0].outputs[0].text
        assert text in ("yes", "no"), (lora, text)

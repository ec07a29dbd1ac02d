"""The offline API's `lora_request=` (issue 35): LLM.chat runs each conversation with its
adapter as generate does, one adapter for all or one each; an adapter is read and checked
before anything is queued, so a bad one raises LoRAAdapterError naming the problem."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.chat_template import encode_chat_prompt
from pagoda.entrypoints.tools.rendering import render_chat
from pagoda.lora.adapter_files import LoRAAdapterError
from pagoda.lora.request import LoRARequest
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer
from tests.lora.peft_adapters import base_model, make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONVERSATION = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_lora")
    folder = build_checkpoint_with_bundled_tokenizer(str(root / "base"))
    make_adapter(str(root / "good"), base_model(), seed=3)  # (shapes of the same tiny model)
    make_adapter(str(root / "rank32"), base_model(), r=32)
    llm = LLM(model=folder, dtype="float32", max_model_len=256, enable_lora=True,
              max_loras=2, kv_cache_memory=1 << 24)
    return llm, folder, {"good": str(root / "good"), "rank32": str(root / "rank32")}


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_chat_runs_each_conversation_with_its_adapter(setup) -> None:
    llm, _, paths = setup
    good = LoRARequest("good", 1, paths["good"])
    text = render_chat(llm.get_tokenizer(), CONVERSATION, None, None, True)
    ids = encode_chat_prompt(llm.get_tokenizer(), text)
    adapted = tokens(llm.generate([ids], GREEDY, lora_request=good, use_tqdm=False))[0]
    base = tokens(llm.generate([ids], GREEDY, use_tqdm=False))[0]
    assert adapted != base
    assert tokens(llm.chat(CONVERSATION, GREEDY, lora_request=good, use_tqdm=False)) == [adapted]
    assert tokens(llm.chat([CONVERSATION, CONVERSATION], GREEDY, lora_request=[good, None],
                           use_tqdm=False)) == [adapted, base]


def test_bad_lora_requests_are_refused_before_anything_runs(setup) -> None:
    llm, folder, paths = setup
    with pytest.raises(LoRAAdapterError, match="'wide'.*rank 32.*--max-lora-rank 16"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("wide", 7, paths["rank32"]))
    with pytest.raises(LoRAAdapterError, match="'gone'"):
        llm.chat(CONVERSATION, GREEDY, lora_request=LoRARequest("gone", 8, folder + "/no"))
    llm.generate(["hi"], GREEDY, lora_request=LoRARequest("good", 1, paths["good"]),
                 use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is already the adapter 'good'"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("other", 1, paths["rank32"]))
    with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts"):
        llm.generate(["hi", "ho"], GREEDY, lora_request=[None])
    with pytest.raises(TypeError, match="must be a LoRARequest"):
        llm.generate(["hi"], GREEDY, lora_request=["good"])
    assert not llm.engine.has_unfinished_requests()


def test_lora_off_refuses_an_adapter(setup) -> None:
    _, folder, paths = setup
    llm = LLM(model=folder, dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)
    with pytest.raises(LoRAAdapterError, match="enable_lora=True"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("good", 1, paths["good"]))

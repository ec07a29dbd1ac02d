"""The bundled GGUF: Pagoda's greedy output is token-identical to transformers' generate()."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda import SamplingParams

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Give me a tip for sleeping better.",
]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model(bundled_gguf):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(bundled_gguf)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def test_greedy_matches_transformers_generate(bundled_llm, hf_model) -> None:
    tokenizer = bundled_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    # min_tokens bans EOS like min_new_tokens does, so both produce NUM_TOKENS tokens.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    ours = bundled_llm.chat(conversations, params, use_tqdm=False)  # all 8 in one batch
    for conversation, output in zip(conversations, ours):
        prompt_ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert output.prompt_token_ids == list(prompt_ids)
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=NUM_TOKENS, do_sample=False,
                min_new_tokens=NUM_TOKENS, pad_token_id=tokenizer.eos_token_id,
            )
        expected = generated[0, len(prompt_ids):].tolist()
        assert output.outputs[0].token_ids == expected, conversation[0]["content"]

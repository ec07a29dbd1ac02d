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
    """transformers generates the 8 in one left-padded batch (5x faster than one by one; the
    same tokens, measured); where its batch and Pagoda's answer differ, its generate() of
    that conversation alone is the oracle, so a near-tie padding moved cannot fail the test."""
    tokenizer = bundled_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    # min_tokens bans EOS like min_new_tokens does, so both produce NUM_TOKENS tokens.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    ours = bundled_llm.chat(conversations, params, use_tqdm=False)  # all 8 in one batch
    prompts = [tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for conversation in conversations]
    batch = hf_generate(hf_model, prompts, tokenizer.eos_token_id)
    for conversation, prompt_ids, output, theirs in zip(conversations, prompts, ours, batch):
        assert output.prompt_token_ids == list(prompt_ids)
        if output.outputs[0].token_ids != theirs:
            theirs = hf_generate(hf_model, [prompt_ids], tokenizer.eos_token_id)[0]
        assert output.outputs[0].token_ids == theirs, conversation[0]["content"]


def hf_generate(hf_model, prompts: list[list[int]], pad_id: int) -> list[list[int]]:
    """transformers' greedy NUM_TOKENS tokens after each prompt, in one batch padded left."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        generated = hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=NUM_TOKENS,
                                      min_new_tokens=NUM_TOKENS, do_sample=False,
                                      pad_token_id=pad_id)
    return generated[:, width:].tolist()

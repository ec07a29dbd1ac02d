"""Long-context rope scalings (layers/rope_scaling.py): YaRN and dynamic NTK against
transformers, their frequencies number for number and tiny random Llama and Qwen3 models
greedy, token for token, through the engine and its paged cache, at positions past the
original context (64 tokens here; prompts of 112-150 tokens, chunked, then decoded).

Dynamic NTK is vLLM's static form in Pagoda (the base computed once for
max_position_embeddings * factor tokens): transformers computes the same numbers only on a
single forward of exactly that many tokens, which is what its tests compare against."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagoda import LLM, SamplingParams
from pagoda.executor.layers.rope_scaling import scaled_context_length
from pagoda.executor.layers.rotary import RotaryEmbedding, rope_parameters
from tests.executor.test_model_families import greedy_reference
from tests.executor.tiny_checkpoints import build_checkpoint

ORIGINAL = 64
"""The tiny models' original (pretraining) context: the prompts run past it."""
YARN_CASES = {
    "plain": {"factor": 4.0},
    "betas-untruncated": {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                          "truncate": False},
    "mscale": {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's form
    "attention-factor": {"factor": 4.0, "attention_factor": 1.25},
}


def yarn_config(case: str, **extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32,
                       max_position_embeddings=4 * ORIGINAL, **extra, rope_scaling={
                           "rope_type": "yarn", "original_max_position_embeddings": ORIGINAL,
                           **YARN_CASES[case]})


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_are_transformers(case, partial) -> None:
    config = yarn_config(case, partial_rotary_factor=partial)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rotary = RotaryEmbedding(config, 32, 4 * ORIGINAL)
    assert rotary.rotary_dim == int(32 * partial)
    assert torch.equal(rotary.inv_freq, inv_freq)
    assert rotary.attention_factor == attention_factor != 1.0
    # cos and sin carry the factor (transformers multiplies them by attention_scaling)
    position = torch.tensor([100])
    angle = position.float()[:, None] * inv_freq
    expected = torch.cat((angle, angle), -1).cos() * attention_factor
    torch.testing.assert_close(rotary.cos_cache[position], expected)


def test_yarn_slows_only_the_long_wavelengths() -> None:
    """The scaling is not the identity: the fastest dimension keeps its frequency, the
    slowest is divided by the factor."""
    config = yarn_config("plain")
    rotary = RotaryEmbedding(config, 32, 4 * ORIGINAL)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    assert rotary.inv_freq[0] == plain[0]
    torch.testing.assert_close(rotary.inv_freq[-1], plain[-1] / 4)


def test_dynamic_ntk_frequencies_are_transformers_at_the_scaled_length() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=ORIGINAL,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    rotary = RotaryEmbedding(config, 16, 2 * ORIGINAL)
    scaled, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=2 * ORIGINAL)
    assert torch.equal(rotary.inv_freq, scaled)
    assert rotary.attention_factor == 1.0
    # the static form: not transformers' reading of a sequence within the original length
    short, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=ORIGINAL)
    assert not torch.allclose(rotary.inv_freq, short)


def test_the_context_length_is_the_scaled_one() -> None:
    """vLLM's reading: YaRN's original context times its factor (Qwen3's published settings:
    40960 positions, factor 4 over 32768), dynamic's max_position_embeddings times its."""
    qwen3 = Qwen3Config(max_position_embeddings=40960, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "rope_theta": 1000000.0})
    assert scaled_context_length(qwen3, rope_parameters(qwen3)) == 131072
    dynamic = LlamaConfig(max_position_embeddings=64,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert scaled_context_length(dynamic, rope_parameters(dynamic)) == 128
    plain = LlamaConfig(max_position_embeddings=64)
    assert scaled_context_length(plain, rope_parameters(plain)) == 64


def test_an_unknown_rope_type_names_the_supported() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    config.rope_parameters = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="'ntk-by-parts' is not supported.*yarn, dynamic"):
        RotaryEmbedding(config, 16, 64)


def scaled_checkpoint(arch: str, scaling: str, folder: str) -> torch.nn.Module:
    """A tiny random `arch` model whose rope is scaled `scaling` over a 64-token original
    context: YaRN factor 4 (Llama: old-style rope_scaling, max_position_embeddings the
    original, as Qwen2.5 ships it; Qwen3: rope_parameters, 256 positions), dynamic factor 2
    over max_position_embeddings 64."""
    if scaling == "dynamic":
        settings = {"rope_type": "dynamic", "factor": 2.0}
        overrides = {"max_position_embeddings": ORIGINAL}
    else:
        settings = {"rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": ORIGINAL}
        overrides = {"max_position_embeddings": ORIGINAL if arch == "llama" else 4 * ORIGINAL}
    if arch == "llama":
        overrides["rope_scaling"] = settings
    else:
        overrides["rope_parameters"] = {**settings, "rope_theta": 10000.0}
    return build_checkpoint(arch, folder, **overrides)


def engine(folder: str, max_model_len: int) -> LLM:
    """4-token blocks, 32 tokens a step: long prompts are prefilled in chunks."""
    from pagoda.executor.loader.model_files import bundled_model_path

    return LLM(model=folder, tokenizer=bundled_model_path(), dtype="float32",
               kv_cache_memory=1 << 20, max_model_len=max_model_len, block_size=4,
               max_num_batched_tokens=32)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(length)]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_yarn_greedy_decoding_past_the_original_context_matches_transformers(
        arch, tmp_path) -> None:
    """150- and 90-token prompts (both past the 64-token original context) in one batch, 16
    tokens each; max_model_len 256, past Llama's max_position_embeddings (64): the scaled
    context. transformers' greedy tokens and their logprobs, step by step."""
    reference = scaled_checkpoint(arch, "yarn", str(tmp_path))
    llm = engine(str(tmp_path), 4 * ORIGINAL)
    prompts = [random_prompt(150, 0), random_prompt(90, 1)]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        completion = out.outputs[0]
        tokens, logprobs = greedy_reference(reference, prompt, 16)
        assert list(completion.token_ids) == tokens
        ours = [position[token].logprob
                for token, position in zip(completion.token_ids, completion.logprobs)]
        torch.testing.assert_close(ours, logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dynamic_ntk_greedy_decoding_matches_transformers_at_the_scaled_length(
        arch, tmp_path) -> None:
    """A 112-token prompt, 16 greedy tokens: 128 tokens, max_position_embeddings * factor,
    the length at which transformers' dynamic base is Pagoda's static one. transformers reads
    the whole 128 tokens in one forward: at every generated position its most likely token
    is the one Pagoda chose, with the same logprob."""
    reference = scaled_checkpoint(arch, "dynamic", str(tmp_path))
    llm = engine(str(tmp_path), 2 * ORIGINAL)
    prompt = random_prompt(2 * ORIGINAL - 16, 2)
    completion = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    tokens = list(completion.token_ids)
    assert len(prompt) + len(tokens) == 2 * ORIGINAL
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    predicting = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # (16, vocab)
    assert predicting.argmax(-1).tolist() == tokens
    ours = [position[token].logprob for token, position in zip(tokens, completion.logprobs)]
    theirs = [predicting[i, token].item() for i, token in enumerate(tokens)]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_engine_takes_the_scaled_context_and_refuses_more(tmp_path) -> None:
    """A YaRN Llama whose max_position_embeddings is its original 64 tokens: the engine's
    context is 256 by default and a longer max_model_len is refused by name."""
    from pagoda.executor.loader.model_files import bundled_model_path

    scaled_checkpoint("llama", "yarn", str(tmp_path))
    llm = LLM(model=str(tmp_path), tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, block_size=4)
    assert llm.engine.max_model_len == 4 * ORIGINAL
    with pytest.raises(ValueError, match="max_model_len 257 is longer than the model's "
                                         "context length 256"):
        engine(str(tmp_path), 4 * ORIGINAL + 1)

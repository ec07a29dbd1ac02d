"""Pagoda's logits equal transformers' on tiny random checkpoints of every supported family."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.config import CacheConfig
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.model_runner import ModelRunner
from tests.executor.tiny_checkpoints import ARCHITECTURES, COMMON, build_checkpoint

PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [1], [120, 4] * 20, list(range(10, 70))]


def pagoda_runner(folder: str) -> ModelRunner:
    files = resolve_model_files(folder)
    checkpoint = open_checkpoint(files)
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=256)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    return runner


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_match_transformers(arch: str, tmp_path) -> None:
    reference = build_checkpoint(arch, str(tmp_path))
    runner = pagoda_runner(str(tmp_path))
    logits = runner.prompt_logits(PROMPTS)  # all prompts in one batched forward
    with torch.no_grad():
        for prompt, ours in zip(PROMPTS, logits):
            theirs = reference(torch.tensor([prompt])).logits[0].float()
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_sharded_safetensors(tmp_path) -> None:
    reference = build_checkpoint("llama", str(tmp_path), max_shard_size="40KB")
    shards = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.exists(tmp_path / "model.safetensors.index.json")
    runner = pagoda_runner(str(tmp_path))
    ours = runner.prompt_logits([PROMPTS[0]])[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_language_model_of_a_llama4_text_and_vision_checkpoint(tmp_path) -> None:
    """Meta publishes Llama 4 as Llama4ForConditionalGeneration (a vision tower beside the
    language model): Pagoda loads the language model alone (the vision tensors unread), and
    its logits on text are transformers' on the whole checkpoint."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "vision_output_dim": 32, "projector_input_dim": 32,
              "projector_output_dim": 64, "image_size": 28, "patch_size": 14}
    torch.manual_seed(0)
    reference = Llama4ForConditionalGeneration(Llama4Config(
        text_config={**COMMON, **ARCHITECTURES["llama4"][2]}, vision_config=vision)).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0, 0.2)
    reference.save_pretrained(tmp_path)
    runner = pagoda_runner(str(tmp_path))
    assert type(runner.model).__name__ == "Llama4ForCausalLM"
    with torch.no_grad():
        for prompt, ours in zip(PROMPTS, runner.prompt_logits(PROMPTS)):
            theirs = reference(input_ids=torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    checkpoint = open_checkpoint(resolve_model_files(str(tmp_path)))
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(dtype, tmp_path) -> None:
    build_checkpoint("qwen2", str(tmp_path))
    files = resolve_model_files(str(tmp_path))
    runner32 = pagoda_runner(str(tmp_path))
    model = load_model(open_checkpoint(files), dtype, torch.device("cpu"), max_position=256)
    assert all(p.dtype == dtype for p in model.parameters())
    runner16 = ModelRunner(model, torch.device("cpu"), dtype, CacheConfig(block_size=4), [])
    runner16.initialize_kv_cache([64] * runner16.num_kv_cache_groups)
    assert runner16.kv_caches[0].dtype == dtype
    for ours, reference in zip(runner16.prompt_logits(PROMPTS), runner32.prompt_logits(PROMPTS)):
        assert ours.dtype == torch.float32  # logits are always returned in float32
        agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        assert agreement > 0.9
        assert (ours - reference).abs().max().item() < 0.5

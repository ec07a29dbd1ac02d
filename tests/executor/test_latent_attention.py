"""DeepSeek's multi-head latent attention in the engine (models/deepseek.py): the paged cache
holds each token's latent and rotary key once (keys only: the values are read from them), an
8-bit cache reads the latent back through its rotation, and a checkpoint's
next-token-prediction layers are ignored. (Logits against transformers, HF folders:
test_model_parity.py; greedy decoding through the engine: test_model_families.py; GGUF
files: test_llama_cpp_files.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.config import CacheConfig
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.model_runner import ModelRunner
from tests.executor.test_model_parity import PROMPTS
from tests.executor.tiny_checkpoints import build_checkpoint

EIGHT_BIT_CACHE_MAX_RELATIVE_ERROR = {"int8": 0.05, "fp8_e4m3": 0.1}
"""Prompt logits through an 8-bit cache against the float cache's, on the tiny random model
(measured: int8 2.3 %, fp8_e4m3 6.7 %); values read from the rotated keys without turning
them back give 155 %."""


def latent_runner(folder: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    model = load_model(open_checkpoint(resolve_model_files(folder)), torch.float32,
                       torch.device("cpu"), max_position=256)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32,
                         CacheConfig(block_size=4, kv_cache_dtype=kv_cache_dtype), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    return runner


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    folder = str(tmp_path_factory.mktemp("deepseek-v3"))
    return folder, build_checkpoint("deepseek-v3", folder)


def test_the_cache_holds_each_tokens_latent_once(deepseek_v3) -> None:
    folder, reference = deepseek_v3
    config = reference.config
    runner = latent_runner(folder)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv_planes == 1 and runner.backend.name == "torch"
    for layer in runner.model.attention_layers():
        assert layer.kv_cache.shape == (1, 1, 64, 4, width)
    assert runner.kv_bytes_per_token == config.num_hidden_layers * width * 4  # float32


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8_bit_cache_reads_the_latent_back(deepseek_v3, kv_cache_dtype) -> None:
    folder, _ = deepseek_v3
    exact = latent_runner(folder).prompt_logits(PROMPTS)
    runner = latent_runner(folder, kv_cache_dtype)
    assert runner.kv_caches[0].codes.shape[0] == 1
    for ours, theirs in zip(runner.prompt_logits(PROMPTS), exact):
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error < EIGHT_BIT_CACHE_MAX_RELATIVE_ERROR[kv_cache_dtype]


def test_next_token_prediction_layers_are_not_loaded(deepseek_v3, tmp_path) -> None:
    """DeepSeek-V3's checkpoints store their MTP layer as model.layers.{num_hidden_layers}:
    the folder still loads, to the same logits."""
    folder, reference = deepseek_v3
    state = load_file(os.path.join(folder, "model.safetensors"))
    last = reference.config.num_hidden_layers - 1
    extra = {name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): tensor.clone()
             for name, tensor in state.items() if name.startswith(f"model.layers.{last}.")}
    extra[f"model.layers.{last + 1}.eh_proj.weight"] = torch.zeros(8, 8)  # (MTP's own)
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(folder, name), tmp_path / name)
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with_mtp = latent_runner(str(tmp_path)).prompt_logits(PROMPTS[:2])
    for ours, theirs in zip(with_mtp, latent_runner(folder).prompt_logits(PROMPTS[:2])):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)

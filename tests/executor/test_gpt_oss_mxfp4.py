"""gpt-oss folders as OpenAI publishes them: the experts in MXFP4 (`*_blocks` / `*_scales`,
quantization_config.quant_method "mxfp4"), decoded at load. The blocks are random codes and
scales, decoded here by the format's definition (byte j of a 16-byte block: element 2j in
its low nibble, 2j + 1 in its high; a scale byte e: 2 ** (e - 127)); Pagoda's logits on the
MXFP4 folder equal transformers' on the same weights stored as floats."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from tests.executor.test_model_families import logits_error
from tests.executor.test_model_parity import pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""E2M1 by its 4-bit code."""


def random_mxfp4(experts: int, rows: int, columns: int, seed: int):
    """(blocks (E, rows, columns / 32, 16) uint8, scales (E, rows, columns / 32) uint8,
    the weight they hold as the float checkpoint stores it: (E, columns, rows))."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (experts, rows, columns // 32, 32), generator=generator)
    scales = torch.randint(121, 126, (experts, rows, columns // 32), generator=generator)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    weight = FP4[codes] * torch.pow(2.0, scales.float() - 127)[..., None]
    return blocks, scales.to(torch.uint8), weight.reshape(experts, rows, columns).transpose(1, 2)


def write_folders(tmp_path) -> tuple[str, str]:
    """(the MXFP4 folder, the same weights as floats)."""
    floats, packed = str(tmp_path / "float"), str(tmp_path / "mxfp4")
    build_checkpoint("gpt-oss", floats)
    state = load_file(os.path.join(floats, "model.safetensors"))
    with open(os.path.join(floats, "config.json")) as f:
        config = json.load(f)
    hidden, size = config["hidden_size"], config["intermediate_size"]
    experts = config["num_local_experts"]
    mxfp4_state = dict(state)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for stacked, rows, columns in (("gate_up_proj", 2 * size, hidden),
                                       ("down_proj", hidden, size)):
            blocks, scales, weight = random_mxfp4(experts, rows, columns, seed=layer * 2 + rows)
            state[f"{prefix}.{stacked}"] = weight.contiguous()
            del mxfp4_state[f"{prefix}.{stacked}"]
            mxfp4_state[f"{prefix}.{stacked}_blocks"] = blocks
            mxfp4_state[f"{prefix}.{stacked}_scales"] = scales
    save_file(state, os.path.join(floats, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(packed)
    save_file(mxfp4_state, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(packed, "config.json"), "w") as f:
        json.dump(config, f)
    return packed, floats


def test_mxfp4_experts_decode_to_the_float_models_weights(tmp_path) -> None:
    packed, floats = write_folders(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    assert logits_error(pagoda_runner(packed), reference) < 1e-4


def test_mxfp4_on_another_architecture_or_half_a_pair_is_refused(tmp_path) -> None:
    packed, _ = write_folders(tmp_path)
    state = load_file(os.path.join(packed, "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks without its down_proj_scales"):
        pagoda_runner(packed)
    with open(os.path.join(packed, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(packed, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="mxfp4 checkpoints load for GptOssForCausalLM only"):
        load_model(open_checkpoint(resolve_model_files(packed)), torch.float32,
                   torch.device("cpu"), max_position=64)

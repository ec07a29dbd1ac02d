"""--lora-dtype (LoRAConfig.lora_dtype, vLLM's flag): the numbers a loaded adapter is stored
in. Under auto an adapter saved by peft in bfloat16 (model.to(torch.bfloat16) before
save_pretrained, as adapters trained in bf16 usually are) stays bfloat16 through the files,
the manager and ModelLoRA, so it holds its file's size; --lora-dtype float32 upcasts it
(twice the bytes, the same numbers); a float32 file stays float32 (the greedy-vs-peft tests
run so)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from pagoda.config import EngineConfig, LoRAConfig
from pagoda.executor.lora.adapter_weights import load_lora_weights
from pagoda.executor.lora.manager import LoRAManager
from pagoda.executor.lora.model_lora import ModelLoRA
from pagoda.lora.adapter_files import read_adapter
from pagoda.lora.request import LoRARequest
from tests.executor.test_model_parity import pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint
from tests.lora.peft_adapters import ALL_TARGETS, base_model, make_adapter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A bf16 and a float32 peft adapter of the tiny llama, and the llama's Pagoda model."""
    bf16 = str(tmp_path_factory.mktemp("bf16"))
    model = get_peft_model(base_model(), LoraConfig(
        r=8, lora_alpha=16, target_modules=ALL_TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.to(torch.bfloat16)
    model.save_pretrained(bf16, safe_serialization=True)
    f32 = str(tmp_path_factory.mktemp("f32"))
    make_adapter(f32, base_model())
    checkpoint = str(tmp_path_factory.mktemp("llama"))
    build_checkpoint("llama", checkpoint)
    return bf16, f32, pagoda_runner(checkpoint).model


def test_the_flag_and_keyword() -> None:
    assert LoRAConfig().lora_dtype == "auto"
    parser = __import__("argparse").ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-dtype", "bfloat16"])
    assert EngineConfig.from_cli_args(args).lora.lora_dtype == "bfloat16"
    assert EngineConfig.from_kwargs(lora_dtype="float32").lora.lora_dtype == "float32"
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32"):
        LoRAConfig(lora_dtype="int8")


def test_auto_keeps_a_bf16_files_numbers(files) -> None:
    bf16, _, _ = files
    adapter = read_adapter(bf16)
    stored = load_file(adapter.weights_path)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    pairs = load_lora_weights(adapter)  # auto
    for pair in pairs.values():
        assert pair.a.dtype == pair.b.dtype == torch.bfloat16
    module = adapter.modules[0]
    assert module.scale == 2.0  # a power of two: B * scale is exact in bf16
    assert torch.equal(pairs[(module.layer, module.target)].b, stored[module.b_name] * 2)
    upcast = load_lora_weights(adapter, "float32")
    for key, pair in pairs.items():
        assert upcast[key].a.dtype == torch.float32
        assert torch.equal(upcast[key].a, pair.a.float())
        assert torch.equal(upcast[key].b, pair.b.float())


def load_through_the_manager(model, folder: str, lora_dtype: str) -> ModelLoRA:
    config = LoRAConfig(enable_lora=True, lora_dtype=lora_dtype)
    lora = ModelLoRA(model, config.max_loras)
    manager = LoRAManager(lora, config, model.config)  # the real loader: read, check, load
    step, failed = manager.step([LoRARequest("a", 1, folder)], ["r"], np.array([3]), {1})
    assert not failed and step is not None
    return lora


@pytest.mark.parametrize("lora_dtype, kind, dtype, size", [
    ("auto", "bf16", torch.bfloat16, 1),  # the file's size, once
    ("float32", "bf16", torch.float32, 2),  # upcast: twice the file's bytes
    ("auto", "f32", torch.float32, 1),
    ("bfloat16", "f32", torch.bfloat16, 0.5),
])
def test_a_loaded_adapter_holds_its_files_size_in_its_dtype(files, lora_dtype, kind, dtype,
                                                            size) -> None:
    bf16, f32, model = files
    folder = bf16 if kind == "bf16" else f32
    lora = load_through_the_manager(model, folder, lora_dtype)
    try:
        fused = lora.fused(0, 0, 1)
        assert fused.a.dtype == dtype and all(p.b_t.dtype == dtype for p in fused.parts)
        assert lora.loaded[1] == size * read_adapter(folder).size_bytes
    finally:
        lora.detach()

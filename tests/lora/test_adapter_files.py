"""PEFT adapter folders as `peft` writes them: read_adapter reads their modules, ranks and
scales from the headers, load_lora_weights' pairs add exactly what peft's merge adds, and
every adapter Pagoda cannot serve exactly is refused with a message naming the problem;
check_adapter holds an adapter against its base model's config and --max-lora-rank."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.executor.lora.adapter_weights import LoRAPair, load_lora_weights
from pagoda.lora.adapter_files import (
    TARGETS,
    AdapterFiles,
    LoRAAdapterError,
    read_adapter,
)
from pagoda.lora.adapter_fit import check_adapter
from tests.lora.peft_adapters import base_model, make_adapter

PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def merged_deltas(peft_model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, target) -> merged weight - base weight, as peft's merge_and_unload makes it."""
    inner = peft_model.base_model.model
    base = {(i, t): getattr(getattr(layer, PARENTS[t]), t).base_layer.weight.detach().clone()
            for i, layer in enumerate(inner.model.layers) for t in TARGETS
            if hasattr(getattr(getattr(layer, PARENTS[t]), t), "base_layer")}
    merged = peft_model.merge_and_unload()
    return {(i, t): getattr(getattr(merged.model.layers[i], PARENTS[t]), t).weight.detach()
            - weight for (i, t), weight in base.items()}


def assert_pairs_match(pairs: dict[tuple[int, str], LoRAPair], deltas) -> None:
    assert sorted(pairs) == sorted(deltas)
    for key, delta in deltas.items():
        pair = pairs[key]
        assert pair.a.dtype == pair.b.dtype == torch.float32
        assert pair.a.is_contiguous() and pair.b.is_contiguous()
        assert delta.abs().max() > 0.1, key  # the adapter does change the weight
        torch.testing.assert_close(pair.b @ pair.a, delta, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (folder, deltas peft's merge gives): four kinds of adapter."""
    root = tmp_path_factory.mktemp("peft")
    kinds = {
        "all": {},
        "qv": {"target_modules": ["q_proj", "v_proj"], "r": 4, "lora_alpha": 8},
        "rslora": {"use_rslora": True, "lora_alpha": 5},
        "patterns": {"rank_pattern": {"v_proj": 4, "model.layers.1.mlp.up_proj": 2},
                     "alpha_pattern": {"layers.0.self_attn.o_proj": 3, "down_proj": 7}},
    }
    found = {}
    for seed, (name, lora) in enumerate(kinds.items(), start=1):
        folder = str(root / name)
        model = make_adapter(folder, base_model(), seed=seed, **lora)
        found[name] = (folder, merged_deltas(model))
    return found


@pytest.fixture(scope="module")
def base_config():
    return base_model().config


def test_reads_a_peft_folder(adapters):
    folder, _ = adapters["all"]
    adapter = read_adapter(folder)
    assert isinstance(adapter, AdapterFiles)
    assert adapter.format == "peft" and adapter.path == folder
    assert adapter.weights_path == os.path.join(folder, "adapter_model.safetensors")
    assert [(m.layer, m.target) for m in adapter.modules] == [
        (layer, t) for layer in range(2) for t in TARGETS]
    sizes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
             "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
    for module in adapter.modules:
        assert (module.in_features, module.out_features) == sizes[module.target]
        assert module.rank == 8 and module.scale == 2.0  # 16 / 8
    assert adapter.max_rank == 8
    # float32 A (8, in) and B (out, 8) of every module
    assert adapter.size_bytes == sum(4 * 8 * (i + o) for i, o in sizes.values()) * 2


def test_only_the_targets_it_has(adapters):
    adapter = read_adapter(adapters["qv"][0])
    assert [(m.layer, m.target, m.rank, m.scale) for m in adapter.modules] == [
        (0, "q_proj", 4, 2.0), (0, "v_proj", 4, 2.0), (1, "q_proj", 4, 2.0),
        (1, "v_proj", 4, 2.0)]


def test_rslora_and_per_module_patterns(adapters):
    rslora = read_adapter(adapters["rslora"][0])
    assert [m.scale for m in rslora.modules] == [pytest.approx(5 / math.sqrt(8))] * 14
    patterns = {(m.layer, m.target): (m.rank, m.scale)
                for m in read_adapter(adapters["patterns"][0]).modules}
    assert patterns[(0, "v_proj")] == patterns[(1, "v_proj")] == (4, 4.0)  # 16 / 4
    assert patterns[(1, "up_proj")] == (2, 8.0)
    assert patterns[(0, "up_proj")] == (8, 2.0)
    assert patterns[(0, "o_proj")] == (8, 3 / 8)
    assert patterns[(1, "o_proj")] == (8, 2.0)
    assert patterns[(0, "down_proj")] == patterns[(1, "down_proj")] == (8, 7 / 8)


@pytest.mark.parametrize("kind", ["all", "qv", "rslora", "patterns"])
def test_loaded_pairs_add_what_peft_merges(adapters, kind):
    folder, deltas = adapters[kind]
    assert_pairs_match(load_lora_weights(read_adapter(folder)), deltas)


def test_loads_in_another_dtype(adapters):
    folder, deltas = adapters["all"]
    pairs = load_lora_weights(read_adapter(folder), dtype=torch.bfloat16)
    pair = pairs[(1, "down_proj")]
    assert pair.a.dtype == pair.b.dtype == torch.bfloat16
    torch.testing.assert_close(pair.b.float() @ pair.a.float(), deltas[(1, "down_proj")],
                               rtol=0.05, atol=0.05)


def test_half_precision_files_are_read(adapters, tmp_path):
    source, deltas = adapters["all"]
    folder = tmp_path / "f16"
    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: v.half() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    adapter = read_adapter(str(folder))
    assert adapter.size_bytes == read_adapter(source).size_bytes // 2
    pairs = load_lora_weights(adapter)  # auto: the file's float16 kept (--lora-dtype)
    assert pairs[(0, "q_proj")].a.dtype == pairs[(0, "q_proj")].b.dtype == torch.float16
    pairs = load_lora_weights(adapter, torch.float32)
    assert pairs[(0, "q_proj")].a.dtype == torch.float32
    torch.testing.assert_close(pairs[(0, "q_proj")].b @ pairs[(0, "q_proj")].a,
                               deltas[(0, "q_proj")], rtol=0.01, atol=0.01)


# -- check_adapter ------------------------------------------------------------------------

def test_check_adapter_accepts_its_base(adapters, base_config):
    for folder, _ in adapters.values():
        check_adapter(read_adapter(folder), base_config, max_lora_rank=8)
    check_adapter(read_adapter(adapters["all"][0]), base_config.to_dict(), max_lora_rank=16)


def test_rank_above_max_lora_rank(adapters, base_config):
    with pytest.raises(LoRAAdapterError, match=r"rank 8, more than --max-lora-rank 4"):
        check_adapter(read_adapter(adapters["all"][0]), base_config, max_lora_rank=4)
    check_adapter(read_adapter(adapters["qv"][0]), base_config, max_lora_rank=4)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 128}, r"layer 0 q_proj is 64 -> 64, but the base model's is 128 -> 64"),
    ({"intermediate_size": 80}, r"gate_proj is 64 -> 96, but the base model's is 64 -> 80"),
    ({"num_key_value_heads": 4}, r"k_proj is 64 -> 32, but the base model's is 64 -> 64"),
    ({"num_hidden_layers": 1}, r"adapts layer 1, but the base model has 1 layers"),
])
def test_check_adapter_refuses_another_base(adapters, base_config, change, message):
    config = {**base_config.to_dict(), **change}
    with pytest.raises(LoRAAdapterError, match=message):
        check_adapter(read_adapter(adapters["all"][0]), config, max_lora_rank=16)


def test_check_adapter_reads_head_dim(adapters):
    qwen3 = base_model("qwen3").config  # head_dim 32 x 4 heads: q_proj is 64 -> 128
    with pytest.raises(LoRAAdapterError, match=r"q_proj is 64 -> 64, but the base model's "
                                               r"is 64 -> 128"):
        check_adapter(read_adapter(adapters["all"][0]), qwen3, max_lora_rank=16)


# -- refusals -----------------------------------------------------------------------------

def edited(source: str, folder, **config_changes) -> str:
    shutil.copytree(source, folder)
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(folder)


def test_missing_path_and_files(adapters, tmp_path):
    with pytest.raises(LoRAAdapterError, match=r"'/nonexistent/lora' does not exist"):
        read_adapter("/nonexistent/lora")
    with pytest.raises(LoRAAdapterError, match=r"has no adapter_config.json"):
        read_adapter(str(tmp_path))
    folder = tmp_path / "no_weights"
    shutil.copytree(adapters["all"][0], folder)
    os.remove(folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match=r"has no adapter_model.safetensors"):
        read_adapter(str(folder))
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoRAAdapterError, match=r"only adapter_model.bin \(a pickle"):
        read_adapter(str(folder))


def test_not_an_adapter(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(LoRAAdapterError, match=r"neither a PEFT folder .* nor a GGUF LoRA"):
        read_adapter(str(path))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match=r"adapter_config.json is not readable JSON"):
        read_adapter(str(tmp_path))


def test_damaged_safetensors(adapters, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(adapters["all"][0], folder)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(LoRAAdapterError, match=r"truncated or damaged safetensors"):
        read_adapter(str(folder))


@pytest.mark.parametrize(("lora", "message"), [
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save .* is not supported"),
    ({"use_dora": True}, r"DoRA \(use_dora\) is not supported"),
    ({"bias": "lora_only"}, r"bias='lora_only' \(trained biases\) is not supported"),
    ({"bias": "all"}, r"bias='all'"),
    ({"lora_bias": True}, r"lora_bias \(a bias on lora_B\) is not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"targets embed_tokens: only q_proj"),
    ({"target_modules": ["v_proj", "lm_head"]}, r"targets lm_head: only q_proj"),
])
def test_refuses_what_peft_made_but_pagoda_cannot_serve(tmp_path, lora, message):
    folder = str(tmp_path / "adapter")
    make_adapter(folder, base_model(), **lora)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(folder)


def test_refuses_targets_outside_the_seven_by_tensor(adapters, tmp_path):
    """A regex target_modules names no module: the tensors themselves are checked."""
    folder = tmp_path / "regex"
    make_adapter(str(folder), base_model(), target_modules=r".*(q_proj|lm_head)")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], str)
    # peft saves lm_head's whole weight beside its A and B
    with pytest.raises(LoRAAdapterError, match=r"'base_model.model.lm_head.base_layer.weight' "
                                               r"is not a LoRA A/B matrix"):
        read_adapter(str(folder))

    def lm_head_pair(tensors):
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.ones(8, 64)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.ones(128, 8)
    folder = rewrite_tensors(adapters["qv"][0], tmp_path / "lm_head", lm_head_pair)
    with pytest.raises(LoRAAdapterError, match=r"targets lm_head: only the decoder layers'"):
        read_adapter(folder)


def test_refuses_moe_experts(adapters, tmp_path):
    """Qwen3-MoE's experts are fused 3D parameters under transformers 5: peft adapts them as
    target_parameters; an older layout's per-expert modules are refused by their names."""
    folder = tmp_path / "moe"
    make_adapter(str(folder), base_model("qwen3-moe"),
                 target_modules=["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(LoRAAdapterError, match=r"target_parameters \(LoRA on raw parameters, "
                                               r"e.g. MoE experts'\) is not supported"):
        read_adapter(str(folder))

    def expert_pair(tensors):
        prefix = "base_model.model.model.layers.1.mlp.experts.3.gate_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.ones(4, 64)
        tensors[f"{prefix}.lora_B.weight"] = torch.ones(32, 4)
    folder = rewrite_tensors(adapters["qv"][0], tmp_path / "experts", expert_pair)
    with pytest.raises(LoRAAdapterError, match=r"targets model.layers.1.mlp.experts.3.gate_proj"
                                               r": only the decoder layers'"):
        read_adapter(folder)


@pytest.mark.parametrize(("change", "message"), [
    ({"peft_type": "IA3"}, r"is a PEFT IA3 adapter, not a LoRA one"),
    ({"fan_in_fan_out": True}, r"fan_in_fan_out .* is not supported"),
    ({"r": 0}, r"no positive 'r'"),
    ({"rank_pattern": {"q_proj": 4}}, r"self_attn.q_proj rank 4 but its tensors have rank 8"),
    ({"alpha_pattern": {"q_proj(": 4}}, r"json's alpha_pattern key 'q_proj\(' is not a valid"),
    ({"rank_pattern": {"v_proj": "8"}}, r"rank_pattern\['v_proj'\] is '8', not a positive"),
])
def test_refuses_configs(adapters, tmp_path, change, message):
    folder = edited(adapters["all"][0], tmp_path / "edited", **change)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(folder)


def rewrite_tensors(source: str, folder, change) -> str:
    shutil.copytree(source, folder)
    path = str(folder / "adapter_model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return str(folder)


def test_refuses_disagreeing_or_missing_tensors(adapters, tmp_path):
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:, :4].contiguous()
    folder = rewrite_tensors(adapters["all"][0], tmp_path / "shrunk", shrink)
    with pytest.raises(LoRAAdapterError, match=r"model.layers.1.mlp.up_proj's A \(8, 64\) and "
                                               r"B \(96, 4\) disagree"):
        read_adapter(folder)
    folder = rewrite_tensors(adapters["all"][0], tmp_path / "missing",
                             lambda tensors: tensors.pop(name))
    with pytest.raises(LoRAAdapterError, match=r"model.layers.1.mlp.up_proj has no lora_B"):
        read_adapter(folder)

    def extra(tensors):
        tensors["base_model.model.model.norm.weight"] = torch.ones(64)
    folder = rewrite_tensors(adapters["all"][0], tmp_path / "extra", extra)
    with pytest.raises(LoRAAdapterError, match=r"'base_model.model.model.norm.weight' is not "
                                               r"a LoRA A/B matrix"):
        read_adapter(folder)


def test_reading_an_adapter_imports_no_torch():
    """The service layer vets adapters (--lora-modules, /v1/load_lora_adapter) without torch."""
    code = ("import sys; import pagoda.lora.adapter_files\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr

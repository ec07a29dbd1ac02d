"""GGUF LoRA adapters as llama.cpp's own convert_lora_to_gguf.py writes them (from the pinned
llama-cpp-python sdist: tests/llama_cpp_tools.py) from peft-made adapters: read_adapter
reads the same modules as from the PEFT folder, and load_lora_weights gives the same pairs
(exactly, for f32 files), the `llama` file's permuted q/k lora_b rows put back in Hugging
Face's order. Hand-written files (the `gguf` package's writer) for each refusal.

Times (2 loaded cores): the converter process ~5 s; the module ~15 s (the sdist is in the
cache; a cold cache fetches it first, 40-60 s).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from pagoda.executor.lora.adapter_weights import load_lora_weights
from pagoda.lora.adapter_files import LoRAAdapterError, read_adapter
from pagoda.lora.adapter_fit import check_adapter
from tests import llama_cpp_tools
from tests.executor.tiny_checkpoints import build_checkpoint
from tests.lora.peft_adapters import base_model, make_adapter

ADAPTERS = {  # name -> (base arch, peft LoraConfig fields, outtypes)
    "llama": ("llama", {}, ("f32", "f16", "q8_0")),
    "llama-qv": ("llama", {"target_modules": ["q_proj", "v_proj"],
                           "rank_pattern": {"v_proj": 4}}, ("f32",)),
    "qwen3": ("qwen3", {}, ("f32",)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (PEFT folder, base config, {outtype: GGUF path}); one converter process."""
    try:
        llama_cpp_tools.llama_cpp_source()
    except llama_cpp_tools.ToolUnavailable as e:  # a missing converter is a failure to see
        pytest.fail(f"llama.cpp's converter is not available: {e}")
    root = tmp_path_factory.mktemp("gguf_lora")
    bases, found, jobs = {}, {}, []
    for arch in {arch for arch, _, _ in ADAPTERS.values()}:
        bases[arch] = build_checkpoint(arch, str(root / f"base-{arch}")).config
    for seed, (name, (arch, lora, outtypes)) in enumerate(ADAPTERS.items(), start=1):
        folder = str(root / name)
        make_adapter(folder, base_model(arch), seed=seed, **lora)
        paths = {outtype: str(root / f"{name}-{outtype}.gguf") for outtype in outtypes}
        jobs += [(folder, str(root / f"base-{arch}"), outtype, path)
                 for outtype, path in paths.items()]
        found[name] = (folder, bases[arch], paths)
    failures = llama_cpp_tools.convert_lora(jobs)
    assert failures == {}
    return found


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_reads_the_modules_of_the_peft_source(converted, name):
    folder, config, paths = converted[name]
    peft, from_gguf = read_adapter(folder), read_adapter(paths["f32"])
    assert from_gguf.format == "gguf" and from_gguf.path == from_gguf.weights_path == paths["f32"]
    assert from_gguf.architecture == ADAPTERS[name][0]
    shape = [(m.layer, m.target, m.rank, m.in_features, m.out_features, m.scale)
             for m in peft.modules]
    assert [(m.layer, m.target, m.rank, m.in_features, m.out_features, m.scale)
            for m in from_gguf.modules] == shape
    assert from_gguf.size_bytes == peft.size_bytes  # f32 both
    check_adapter(from_gguf, config, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=r"more than --max-lora-rank 4"):
        check_adapter(from_gguf, config, max_lora_rank=4)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_loaded_pairs_equal_the_peft_ones(converted, name):
    folder, config, paths = converted[name]
    expected = load_lora_weights(read_adapter(folder))
    got = load_lora_weights(read_adapter(paths["f32"]), base_config=config)
    assert sorted(got) == sorted(expected)
    for key, pair in expected.items():
        assert torch.equal(got[key].a, pair.a), key
        assert torch.equal(got[key].b, pair.b), key


def test_the_llama_files_q_k_rows_were_permuted(converted):
    """The un-permutation is what makes them equal: read as stored, q and k's B differ."""
    folder, _, paths = converted["llama"]
    expected = load_lora_weights(read_adapter(folder))
    as_stored = dataclasses.replace(read_adapter(paths["f32"]), architecture=None)
    raw = load_lora_weights(as_stored)
    for layer in range(2):
        for target in ("q_proj", "k_proj"):
            assert not torch.equal(raw[(layer, target)].b, expected[(layer, target)].b)
            assert torch.equal(raw[(layer, target)].a, expected[(layer, target)].a)
        for target in ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert torch.equal(raw[(layer, target)].b, expected[(layer, target)].b)
    with pytest.raises(LoRAAdapterError, match=r"a `llama` GGUF adapter needs the base "
                                               r"model's config"):
        load_lora_weights(read_adapter(paths["f32"]))
    # a Qwen3 file is not permuted: no config needed
    qwen3_folder, _, qwen3_paths = converted["qwen3"]
    assert torch.equal(load_lora_weights(read_adapter(qwen3_paths["f32"]))[(1, "q_proj")].b,
                       load_lora_weights(read_adapter(qwen3_folder))[(1, "q_proj")].b)


@pytest.mark.parametrize(("outtype", "tolerance", "dtype"), [
    ("f16", 1e-3, torch.float16),  # --lora-dtype auto keeps an F16 file's numbers
    ("q8_0", 2e-2, torch.float32),  # a quantized file becomes float32
])
def test_rounded_files(converted, outtype, tolerance, dtype):
    folder, config, paths = converted["llama"]
    adapter = read_adapter(paths[outtype])
    assert adapter.size_bytes < read_adapter(folder).size_bytes / 1.8
    expected = load_lora_weights(read_adapter(folder))
    got = load_lora_weights(adapter, base_config=config)
    for key, pair in expected.items():
        delta, got_delta = pair.b @ pair.a, got[key].b.float() @ got[key].a.float()
        assert got[key].a.dtype == got[key].b.dtype == dtype
        assert (got_delta - delta).norm() / delta.norm() < tolerance, key


def test_another_base_is_refused(converted):
    _, qwen3_config, _ = converted["qwen3"]
    _, _, paths = converted["llama"]
    with pytest.raises(LoRAAdapterError, match=r"a GGUF adapter for a 'llama' model, but the "
                                               r"base model is 'qwen3'"):
        check_adapter(read_adapter(paths["f32"]), qwen3_config, max_lora_rank=16)


# -- hand-written files -------------------------------------------------------------------

def write(path, tensors: dict[str, np.ndarray], general_type: str = "adapter",
          adapter_type: str | None = "lora", alpha: float = 16.0) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(general_type)
    if adapter_type is not None:
        writer.add_string("adapter.type", adapter_type)
        writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def pair(rank: int = 8, in_features: int = 64, out_features: int = 64, part: str = "attn_v",
         layer: int = 0, b_rank: int | None = None) -> dict[str, np.ndarray]:
    name = f"blk.{layer}.{part}.weight"
    return {f"{name}.lora_a": np.ones((rank, in_features), np.float32),
            f"{name}.lora_b": np.ones((out_features, b_rank or rank), np.float32)}


def test_a_hand_written_adapter_reads(tmp_path):
    adapter = read_adapter(write(tmp_path / "ok.gguf", {**pair(part="attn_v", out_features=32),
                                                        **pair(4, 96, 64, "ffn_down", 1)}))
    assert [(m.layer, m.target, m.rank, m.in_features, m.out_features, m.scale)
            for m in adapter.modules] == [(0, "v_proj", 8, 64, 32, 2.0),
                                          (1, "down_proj", 4, 96, 64, 4.0)]
    # alpha 0: llama.cpp's scale is 1
    zero = read_adapter(write(tmp_path / "zero.gguf", pair(), alpha=0.0))
    assert zero.modules[0].scale == 1.0
    pairs = load_lora_weights(read_adapter(str(tmp_path / "ok.gguf")))
    assert torch.equal(pairs[(1, "down_proj")].b, torch.full((64, 4), 4.0))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"general_type": "model", "adapter_type": None},
     r"is a GGUF file but not a LoRA adapter \(general.type = 'model'"),
    ({"adapter_type": "control_vector"}, r"adapter.type = 'control_vector'"),
])
def test_not_a_lora_gguf(tmp_path, kwargs, message):
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(write(tmp_path / "x.gguf", pair(), **kwargs))


@pytest.mark.parametrize(("tensors", "message"), [
    ({"token_embd.weight.lora_a": np.ones((8, 128), np.float32),
      "token_embd.weight.lora_b": np.ones((64, 8), np.float32)},
     r"tensor 'token_embd.weight.lora_a' is not a LoRA A/B matrix of a decoder projection"),
    (pair(part="attn_norm"), r"'blk.0.attn_norm.weight.lora_a' is not a LoRA A/B matrix"),
    ({"blk.0.attn_v.weight.lora_a": np.ones((8, 64), np.float32)},
     r"layer 0 v_proj has no lora_B tensor"),
    (pair(b_rank=4), r"layer 0 v_proj's A \(8, 64\) and B \(64, 4\) disagree"),
    ({"blk.0.attn_v.weight.lora_a": np.ones((8, 64), np.float64),
      "blk.0.attn_v.weight.lora_b": np.ones((64, 8), np.float64)},
     r"tensor 'blk.0.attn_v.weight.lora_a' has ggml type 28; supported: F32, F16, Q8_0, BF16"),
])
def test_refused_tensors(tmp_path, tensors, message):
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(write(tmp_path / "x.gguf", tensors))


def test_truncated_file(tmp_path):
    path = tmp_path / "x.gguf"
    write(path, pair())
    data = path.read_bytes()
    for cut in (len(data) - 100, 60):
        path.write_bytes(data[:cut])
        with pytest.raises(LoRAAdapterError, match=r"truncated GGUF"):
            read_adapter(str(path))

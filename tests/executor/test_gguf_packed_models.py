"""GGUF files load packed in their own types (pagoda/executor/loader/gguf_packed.py): every
quantized matrix of a mixed file (as a Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0) becomes a
PackedLinear / PackedEmbedding / packed head in its type, no float copy, and the model's
logits equal those of the same file loaded as float (--quantization none: the dequantized
weights) within float32 rounding."""

from __future__ import annotations

import gc
import weakref

import gguf
import pytest
import torch

from pagoda.config import CacheConfig
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.packed_linear import PackedEmbedding, PackedLinear
from pagoda.executor.loader.gguf_writer import write_hf_checkpoint as write_gguf
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint, weight_formats
from pagoda.executor.model_runner import ModelRunner
from tests.executor.test_model_families import GGUF_SETTINGS
from tests.executor.tiny_checkpoints import build_checkpoint

Q = gguf.GGMLQuantizationType
PROMPTS = [[1, 5, 9, 100, 7, 3, 64, 11, 90, 2], [4, 4, 8, 15, 16, 23, 42]]
# hidden 256 and intermediate 512: whole 256-weight K-quant super-blocks on every input size
K_SIZES = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
           "num_attention_heads": 4, "num_key_value_heads": 2}
MIXED = {  # (layer, projection) -> type: each fused qkv / gate-up mixes types in layer 0
    (0, "q_proj"): Q.Q4_K, (0, "k_proj"): Q.Q5_K, (0, "v_proj"): Q.Q6_K, (0, "o_proj"): Q.Q5_0,
    (0, "gate_proj"): Q.Q4_0, (0, "up_proj"): Q.Q5_1, (0, "down_proj"): Q.Q8_0,
    (1, "q_proj"): Q.Q4_1, (1, "k_proj"): Q.Q4_1, (1, "v_proj"): Q.Q4_1, (1, "o_proj"): Q.Q6_K,
    (1, "gate_proj"): Q.Q4_K, (1, "up_proj"): Q.Q4_K, (1, "down_proj"): Q.Q5_K,
}
FORMAT_OF = {Q.Q4_0: "q4", Q.Q4_1: "q4", Q.Q5_0: "q5", Q.Q5_1: "q5", Q.Q8_0: "q8",
             Q.Q4_K: "q4k", Q.Q5_K: "q5k", Q.Q6_K: "q6k"}


def mixed_type(name: str):
    if name == "model.embed_tokens.weight":
        return Q.Q6_K
    if name == "lm_head.weight":
        return Q.Q8_0
    parts = name.split(".")
    if parts[0] == "model" and parts[1] == "layers" and parts[-1] == "weight":
        return MIXED.get((int(parts[2]), parts[-2]))
    return None


def load_both(path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The file loaded packed (auto) and as float (none)."""
    files = resolve_model_files(path)
    return tuple(load_model(open_checkpoint(files), torch.float32, torch.device("cpu"),
                            max_position=256, quantization=choice)
                 for choice in ("auto", "none"))


def prompt_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    return runner.prompt_logits(PROMPTS)


def assert_same_logits(packed: torch.nn.Module, reference: torch.nn.Module) -> None:
    for ours, theirs in zip(prompt_logits(packed), prompt_logits(reference), strict=True):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= 1e-4 * max(scale, 1.0)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("mixed"))
    build_checkpoint("llama", folder, **K_SIZES)
    path = f"{folder}/mixed.gguf"
    write_gguf(folder, path, mixed_type)
    return path


def test_a_mixed_file_runs_each_matrix_packed_in_its_own_type(mixed_llama) -> None:
    packed, reference = load_both(mixed_llama)
    layers = packed.model.layers
    assert layers[0].self_attn.qkv_proj.formats == ["q4k", "q5k", "q6k"]  # three segments
    assert layers[1].self_attn.qkv_proj.formats == ["q4"]  # one type: one matmul
    for index in (0, 1):
        for module_name in ("self_attn.o_proj", "mlp.down_proj"):
            module = layers[index].get_submodule(module_name)
            assert isinstance(module, PackedLinear)
            assert module.formats == [FORMAT_OF[MIXED[(index, module_name.split(".")[1])]]]
    assert layers[0].mlp.gate_up_proj.formats == ["q4", "q5"]
    assert layers[1].mlp.gate_up_proj.formats == ["q4k"]
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert packed.model.embed_tokens.table.format == "q6k"
    assert packed.quantized_head.formats == ["q8"]
    assert not [n for n, m in packed.named_modules() if isinstance(m, Linear)]
    assert not [n for n, p in packed.named_parameters() if p.dim() == 2]  # no float matrix
    assert weight_formats(packed) == "packed q4/q4k/q5/q5k/q6k/q8"
    assert_same_logits(packed, reference)


def test_a_tied_embedding_is_the_packed_head_too(tmp_path) -> None:
    folder = str(tmp_path)
    build_checkpoint("smollm-tied", folder, **K_SIZES)
    write_gguf(folder, f"{folder}/tied.gguf", lambda name: Q.Q8_0 if name.endswith(
        "embed_tokens.weight") else (Q.Q4_K if name.endswith("proj.weight") else None))
    packed, reference = load_both(f"{folder}/tied.gguf")
    assert packed.lm_head is None
    assert packed.quantized_head.segments[0] is packed.model.embed_tokens.table
    assert_same_logits(packed, reference)


def test_a_fused_module_with_a_float_part_loads_as_float(tmp_path) -> None:
    """v in float32 while q and k are quantized: the fused qkv cannot be one packed layer,
    so all of it loads dequantized; the other matrices stay packed."""
    folder = str(tmp_path)
    build_checkpoint("llama", folder)
    write_gguf(folder, f"{folder}/partial.gguf", lambda name: None if "v_proj" in name else (
        Q.Q8_0 if name.endswith("proj.weight") else None))
    packed, reference = load_both(f"{folder}/partial.gguf")
    assert type(packed.model.layers[0].self_attn.qkv_proj) is not PackedLinear
    assert isinstance(packed.model.layers[0].self_attn.o_proj, PackedLinear)
    assert_same_logits(packed, reference)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_experts_of_a_stacked_gguf_tensor_are_packed_one_by_one(tmp_path, arch) -> None:
    folder = str(tmp_path)
    build_checkpoint(arch, folder, **GGUF_SETTINGS[arch])
    write_gguf(folder, f"{folder}/moe.gguf",
               lambda name: Q.Q8_0 if "experts" in name else (
                   Q.Q4_0 if name.endswith("proj.weight") else None))
    packed, reference = load_both(f"{folder}/moe.gguf")
    experts = [m for n, m in packed.named_modules() if ".experts." in n and isinstance(
        m, PackedLinear)]
    assert experts and {f for m in experts for f in m.formats} == {"q8"}
    assert_same_logits(packed, reference)


def test_loading_leaves_no_cycle_holding_the_file_mapping(mixed_llama) -> None:
    """The checkpoint (and its memory-mapped file) dies when the caller drops it, without a
    garbage-collector pass: a 1B Q4_K_M file's pages otherwise stayed resident after loading
    (0.65 GB of the process's RSS) until the next gc cycle."""
    gc.collect()
    gc.disable()
    try:
        checkpoint = open_checkpoint(resolve_model_files(mixed_llama))
        alive = weakref.ref(checkpoint)
        model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=64,
                           quantization="auto")
        assert weight_formats(model)  # loaded packed
        del checkpoint
        assert alive() is None
    finally:
        gc.enable()

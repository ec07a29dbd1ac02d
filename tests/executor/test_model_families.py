"""The families beyond dense Llama: Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE (OLMoE: its HF
folder in test_model_parity.py, its GGUF as llama.cpp converts it in test_llama_cpp_files.py).

Their HF-folder logits are in test_model_parity.py (ARCHITECTURES); here: the GGUF form
(written as llama.cpp's converter writes it), greedy decoding through the engine and the
paged cache against transformers, quantized linears, and the lists of what is supported."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.moe import Router, SparseMoeBlock
from pagoda.executor.layers.quantization import QuantizedLinear
from pagoda.executor.loader import gguf_architectures
from pagoda.executor.loader.gguf_writer import write_hf_checkpoint as write_gguf
from pagoda.executor.loader.model_files import ModelLoadError, resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.models import supported
from pagoda.executor.models.registry import MODEL_REGISTRY
from tests.executor.test_model_parity import PROMPTS, pagoda_runner
from tests.executor.test_quantization import MODEL_MAX_RELATIVE_ERROR, relative_error
from tests.executor.tiny_checkpoints import build_checkpoint

FAMILIES = ["gemma2", "gemma3", "phi3", "phi3-longrope", "mixtral", "qwen3-moe"]
GGUF_SETTINGS = {
    # llama.cpp knows these by family, not from the file: the tiny models follow them.
    "gemma2": {"query_pre_attn_scalar": 16},  # head_dim
    "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 7,  # 5 of 6 layers slide
               "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
    "phi3": {},
    "phi3-longrope": {},
    "mixtral": {"sliding_window": None},  # a llama file has no window
    "qwen3-moe": {"mlp_only_layers": [], "norm_topk_prob": True},  # llama.cpp renormalises
    "olmoe": {"clip_qkv": None},  # llama.cpp's converter writes no clamp, its graph has none
    "glm4-moe": {"n_group": 1, "topk_group": 1},  # llama.cpp's graph has no expert groups
    "gpt-oss": {"swiglu_limit": 7.0},  # llama.cpp's graph: the published clamp, not the file's
    # the published configs' routing key, from which the converter writes the gating function
    # (transformers' DeepSeek configs have none: it keeps the extra field)
    "deepseek-v2": {"scoring_func": "softmax"},
    "deepseek-v3": {"scoring_func": "sigmoid"},
    # llama.cpp's llama4 graph fixes the chunk, the NoPE pattern and the temperature floor
    "llama4": {"no_rope_layer_interval": 4, "attention_chunk_size": 8192, "floor_scale": 8192},
    # the file's LongRoPE attention factor is llama.cpp's formula, not the config's mscale
    "phimoe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
               "router_jitter_noise": 0.01},  # (the file has no jitter eps: the family's)
}


def logits_error(runner, reference, prompts=PROMPTS) -> float:
    ours = runner.prompt_logits(prompts)
    with torch.no_grad():
        return max((logits - reference(torch.tensor([prompt])).logits[0]).abs().max().item()
                   for prompt, logits in zip(prompts, ours))


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_logits_match_transformers(arch, tmp_path) -> None:
    folder, path = str(tmp_path / "hf"), str(tmp_path / "model.gguf")
    reference = build_checkpoint(arch, folder, **GGUF_SETTINGS[arch])
    write_gguf(folder, path)
    runner = pagoda_runner(path)
    assert type(runner.model).__name__ == reference.config.architectures[0]
    assert logits_error(runner, reference) < 1e-4


@pytest.mark.parametrize("arch", ["gemma3", "qwen3-moe"])
def test_the_test_gguf_writer_agrees_with_transformers_reader(arch, tmp_path) -> None:
    """Keeps gguf_writer.py honest: transformers' own GGUF reader (which follows llama.cpp's
    conventions: 1 + w norms, stacked experts) gets the original model back from the file.
    Its reader assumes defaults for what the file does not say, so the model uses them."""
    from transformers import AutoModelForCausalLM

    settings = {
        "gemma3": {"query_pre_attn_scalar": 256, "sliding_window_pattern": 6,
                   "num_hidden_layers": 7, "rope_local_base_freq": 10000.0,
                   "rope_scaling": None},
        "qwen3-moe": {**GGUF_SETTINGS["qwen3-moe"], "moe_intermediate_size": 768},
    }[arch]
    folder = str(tmp_path / "hf")
    reference = build_checkpoint(arch, folder, **settings)
    write_gguf(folder, str(tmp_path / "model.gguf"))
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(prompt).logits, reference(prompt).logits)


def greedy_reference(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, each step a full forward over the sequence (no cache),
    with each chosen token's logprob."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(torch.log_softmax(logits, -1)[token].item())
            ids.append(token)
    return ids[len(prompt):], logprobs


@pytest.mark.slow
@pytest.mark.parametrize("arch", [*FAMILIES, "gpt-oss", "phimoe", "deepseek-v2", "deepseek-v3",
                                  "llama4"])
def test_greedy_decoding_through_the_paged_cache_matches_transformers(arch, tmp_path) -> None:
    """The engine end to end on a tiny folder (the bundled tokenizer only for the engine's
    start; prompts are token ids): 4-token blocks, chunked prefill of 16 tokens a step, so
    prompts longer than the windows (8 for Gemma and gpt-oss, 16 for Phi-3 and Mixtral;
    gpt-oss's sinks in decode steps and chunks alike) are computed
    in chunks beside other sequences' decode steps, then decoded through the cache."""
    from pagoda.executor.loader.model_files import bundled_model_path

    reference = build_checkpoint(arch, str(tmp_path))
    llm = LLM(model=str(tmp_path), tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, max_model_len=128, block_size=4,
              max_num_batched_tokens=16)
    prompts = [list(range(3, 40)), [120, 4] * 9, [7, 8]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = out.outputs[0]
        tokens, logprobs = greedy_reference(reference, prompt, 8)
        assert list(completion.token_ids) == tokens
        ours = [position[token].logprob
                for token, position in zip(completion.token_ids, completion.logprobs)]
        torch.testing.assert_close(ours, logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, method", [("gemma2", "int8"), ("gemma3", "int4"),
                                          ("qwen3-moe", "int8"), ("mixtral", "int8"),
                                          ("phimoe", "int8")])
def test_quantized_linears(arch, method, tmp_path) -> None:
    """Every linear of attention, MLPs and experts quantized (the routers stay float: they are
    small and top-k choices are sensitive); logits stay near float32's. Measured relative
    errors: int8 1.3-1.9% on every new family; int4 19% (Gemma 3), 20% (Phi-3), 25-28%
    (Mixtral, Qwen3-MoE, Gemma 2: routing flips and soft-caps compound on random weights),
    against the 25% bar of test_quantization.py. PhiMoE: its logits head's bias kept by the
    int8 head."""
    build_checkpoint(arch, str(tmp_path))
    files = resolve_model_files(str(tmp_path))
    model = load_model(open_checkpoint(files), torch.float32, torch.device("cpu"),
                       max_position=256, quantization=method)
    layers = [m for m in model.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.method == method for m in layers)  # (the logits head is int8)
    moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert bool(moe_blocks) == (arch in ("qwen3-moe", "mixtral", "phimoe"))
    for block in moe_blocks:
        assert isinstance(block.gate, Router) and block.gate.weight.dtype == torch.float32
        assert not any(isinstance(m, Linear) for m in block.experts.modules())
        assert sum(isinstance(m, QuantizedLinear) for m in block.experts.modules()) == 2 * len(
            block.experts)  # fused gate/up and down, each expert
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    float_runner = pagoda_runner(str(tmp_path))
    for ours, reference in zip(runner.prompt_logits(PROMPTS), float_runner.prompt_logits(PROMPTS)):
        assert relative_error(ours, reference) < MODEL_MAX_RELATIVE_ERROR[method]


def test_supported_lists_match_the_implementations() -> None:
    from pagoda.executor.loader.safetensors_loader import TEXT_OF_MULTIMODAL

    assert set(supported.HF_ARCHITECTURES) == set(MODEL_REGISTRY) | set(TEXT_OF_MULTIMODAL)
    assert set(supported.GGUF_ARCHITECTURES) == set(gguf_architectures.GGUF_ARCHITECTURES)


def test_pagoda_help_lists_the_architectures() -> None:
    from pagoda.cli.main import build_parser

    text = " ".join(build_parser().format_help().split())
    for name in supported.HF_ARCHITECTURES + supported.GGUF_ARCHITECTURES:
        assert name in text


def test_unsupported_gguf_architecture_names_the_supported(tmp_path) -> None:
    import gguf

    path = str(tmp_path / "model.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'.*gemma2"):
        open_checkpoint(resolve_model_files(path))


def test_unsupported_hf_architecture_names_the_new_families(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path)
    checkpoint = open_checkpoint(resolve_model_files(str(tmp_path)))
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*MixtralForCausalLM.*Phi3"):
        load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=64)


def test_a_gguf_expert_tensor_splits_into_experts() -> None:
    names = gguf_architectures.hf_tensor_names("qwen3moe", "blk.2.ffn_up_exps.weight",
                                               (4, 32, 64), 4)
    assert names == [f"model.layers.2.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    # older Mixtral files: one tensor per expert
    assert gguf_architectures.hf_tensor_names("mixtral", "blk.0.ffn_down.3.weight",
                                              (64, 96), 8) == [
        "model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    assert gguf_architectures.hf_tensor_names("mixtral", "blk.0.ffn_down.weight",
                                              (64, 96), 8) is None


def test_gguf_files_name_their_weights_in_load_order(tmp_path) -> None:
    """tensor_names (which the layer-by-layer quantization reads) follows iter_weights, expert
    splits included."""
    folder, path = str(tmp_path / "hf"), str(tmp_path / "model.gguf")
    build_checkpoint("qwen3-moe", folder, **GGUF_SETTINGS["qwen3-moe"])
    write_gguf(folder, path)
    checkpoint = open_checkpoint(resolve_model_files(path))
    assert checkpoint.tensor_names() == [name for name, _ in checkpoint.iter_weights(torch.float32)]
    assert os.path.getsize(path) > 0

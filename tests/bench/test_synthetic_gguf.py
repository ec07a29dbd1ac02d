"""benchmarks/synthetic_gguf.py: random-weight GGUFs of real models' shapes.

The shapes are checked against the published parameter counts (with each model's own
vocabulary), and a one-layer file of each architecture is read by transformers (the oracle:
its GGUF reader follows llama.cpp's converter) and by Pagoda with the same logits, so the
files are what the peers load too."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import synthetic_gguf
from pagoda.executor.loader.gguf_random_model import tokenizer_fields
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from tests.executor.test_model_parity import PROMPTS, pagoda_runner

pytestmark = pytest.mark.slow  # writes and loads ~0.3 GB files (make test-fast skips it)

PUBLISHED = {  # name -> (the model's own vocabulary, its published parameter count)
    "llama-3.2-1b": (128256, 1_235_814_400),
    "llama-3.2-3b": (128256, 3_212_749_824),
    "llama-3.1-8b": (128256, 8_030_261_248),
    "qwen2.5-1.5b": (151936, 1_543_714_304),
    "qwen3-30b-a3b": (151936, 30_532_122_624),  # transformers' Qwen3MoeForCausalLM counts it
    "olmoe-1b-7b": (50304, 6_919_161_856),
    "gpt-oss-20b": (201088, 20_914_757_184),  # GptOssForCausalLM's count, sinks and biases in
}


SMALL_VOCABULARY = 2048


@pytest.fixture(scope="module")
def small_vocabulary(tmp_path_factory) -> str:
    """A GGUF holding only a tokenizer: the bundled one's first 2048 tokens and the merges
    that make them, for the files transformers reads here (its reader parses a 49k-token
    vocabulary's arrays for ~8 s a file; the files' layout does not depend on it)."""
    path = str(tmp_path_factory.mktemp("vocabulary") / "small.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    fields = {key: (value, kind, sub_type)
              for key, value, kind, sub_type in tokenizer_fields(synthetic_gguf.bundled_model())}
    kept = fields["tokenizer.ggml.tokens"][0][:SMALL_VOCABULARY]
    known = set(kept)
    for key, (value, kind, sub_type) in fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:SMALL_VOCABULARY]
        elif key == "tokenizer.ggml.merges":
            value = [merge for merge in value if merge.replace(" ", "") in known]
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", sorted(synthetic_gguf.SHAPES))
def test_the_shapes_are_the_published_models(name) -> None:
    vocab, count = PUBLISHED[name]
    assert synthetic_gguf.parameter_count(synthetic_gguf.SHAPES[name], vocab) == count


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-1.5b"])
def test_a_written_file_reads_the_same_in_transformers_and_pagoda(name, tmp_path,
                                                                 small_vocabulary) -> None:
    path = tmp_path / f"{name}.gguf"
    synthetic_gguf.main([name, str(path), "--layers", "1", "--outtype", "f16",
                         "--tokenizer-from", small_vocabulary])
    shape = synthetic_gguf.SHAPES[name]
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    config = reference.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (
        shape.hidden, 1, shape.kv_heads, shape.ffn, SMALL_VOCABULARY)
    runner = pagoda_runner(str(path))
    with torch.no_grad():
        for prompt, ours in zip(PROMPTS, runner.prompt_logits(PROMPTS), strict=True):
            theirs = reference(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_file_reads_the_same_in_transformers_and_pagoda(
        tmp_path, small_vocabulary) -> None:
    """Qwen3-30B-A3B's per-layer shapes (head_dim 128 beside hidden / heads 64, q/k norms,
    a float32 router, stacked experts) with 8 of its 128 experts, 2 chosen a token."""
    path = tmp_path / "moe.gguf"
    small = dataclasses.replace(synthetic_gguf.SHAPES["qwen3-30b-a3b"], layers=1, experts=8,
                                experts_used=2)
    synthetic_gguf.write("qwen3-30b-a3b", small, str(path), small_vocabulary)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    config = reference.config
    assert (config.head_dim, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size) == (128, 8, 2, 768)
    runner = pagoda_runner(str(path))
    assert type(runner.model.model.layers[0].mlp).__name__ == "SparseMoeBlock"
    with torch.no_grad():
        for prompt, ours in zip(PROMPTS, runner.prompt_logits(PROMPTS), strict=True):
            theirs = reference(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_q8_0_files_load_packed(tmp_path) -> None:
    path = tmp_path / "small.gguf"
    small = dataclasses.replace(synthetic_gguf.SHAPES["llama-3.2-1b"], layers=1)
    synthetic_gguf.write("llama-3.2-1b", small, str(path), synthetic_gguf.bundled_model(), "q8_0")
    model = load_model(open_checkpoint(resolve_model_files(str(path))), torch.float32,
                       torch.device("cpu"), max_position=256, quantization="auto")
    assert model.model.layers[0].mlp.down_proj.formats == ["q8"]


def test_bad_arguments_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        synthetic_gguf.main(["llama-3.2-1b", "/tmp/never.gguf", "--layers", "0"])
    assert exit_info.value.code == 2
    assert "--layers must be at least 1" in capsys.readouterr().err


def test_the_context_length_can_be_set(tmp_path) -> None:
    """benchmarks/long_context_decode.sh writes a file whose context covers a 16k depth."""
    import gguf

    path = tmp_path / "long.gguf"
    synthetic_gguf.main(["llama-3.2-1b", str(path), "--layers", "1", "--outtype", "q8_0",
                         "--context", "32768"])
    assert gguf.GGUFReader(str(path)).fields["llama.context_length"].contents() == 32768
    config = open_checkpoint(resolve_model_files(str(path))).hf_config
    assert config.max_position_embeddings == 32768
    with pytest.raises(SystemExit) as exit_info:
        synthetic_gguf.main(["llama-3.2-1b", str(path), "--context", "0"])
    assert exit_info.value.code == 2

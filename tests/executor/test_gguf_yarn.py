"""YaRN in GGUF files as llama.cpp's converter (convert_hf_to_gguf.py, tests/llama_cpp_tools.py)
writes them: `<arch>.rope.scaling.type` "yarn", `.factor`, `.original_context_length` and the
`yarn_*` fields the config had. Pagoda reads them back into the Hugging Face rope settings the
checkpoint had, and decodes the f32 file as transformers decodes the checkpoint, past the
original context. Tiny random Llama (old-style rope_scaling, the defaults, max_position_embeddings
the original: Qwen2.5's form) and Qwen3 (rope_parameters, betas and attention factor given).
Also (fast, our own writer, pagoda/executor/loader/gguf_writer.py): yarn_log_multiplier read as mscale_all_dim, and the
errors a file with rope settings Pagoda cannot run gets."""

from __future__ import annotations

import gguf
import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor.layers.rotary import rope_parameters
from pagoda.executor.loader.gguf_writer import write_hf_checkpoint as write_gguf
from pagoda.executor.loader.model_files import (
    ModelLoadError,
    bundled_model_path,
    resolve_model_files,
)
from pagoda.executor.loader.model_loader import open_checkpoint
from tests import llama_cpp_tools
from tests.executor.test_long_context_rope import random_prompt
from tests.executor.test_model_families import greedy_reference, logits_error
from tests.executor.test_model_parity import pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint, bundled_tokenizer

ORIGINAL = 64
SETTINGS = {
    "llama": {"max_position_embeddings": ORIGINAL, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
    "qwen3": {"max_position_embeddings": 4 * ORIGINAL, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25,
        "rope_theta": 1000000.0}},
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """arch -> (the transformers model, its f32 GGUF file), one converter process."""
    try:
        llama_cpp_tools.llama_cpp_source()
    except llama_cpp_tools.ToolUnavailable as e:
        pytest.fail(f"llama.cpp's converter is not available: {e}")
    root, tokenizer = tmp_path_factory.mktemp("yarn_gguf"), bundled_tokenizer()
    models, jobs = {}, []
    for arch, settings in SETTINGS.items():
        folder = root / arch
        models[arch] = build_checkpoint(
            arch, str(folder), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, **settings)
        tokenizer.save_pretrained(str(folder))
        jobs.append((str(folder), "f32", str(root / f"{arch}-f32.gguf")))
    failures = llama_cpp_tools.convert(jobs)
    assert not failures, failures
    return {arch: (models[arch], path) for arch, (_, _, path) in zip(SETTINGS, jobs)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(SETTINGS))
def test_the_files_yarn_fields_read_back_as_the_checkpoints_rope_settings(
        arch, converted) -> None:
    reference, path = converted[arch]
    checkpoint = open_checkpoint(resolve_model_files(path))
    fields = checkpoint.reader.fields
    prefix = f"{checkpoint.architecture}.rope.scaling"
    assert fields[f"{prefix}.type"].contents() == "yarn"
    assert fields[f"{prefix}.original_context_length"].contents() == ORIGINAL
    assert (f"{prefix}.yarn_beta_fast" in fields) == (arch == "qwen3")
    ours, theirs = rope_parameters(checkpoint.hf_config), rope_parameters(reference.config)
    assert ours["rope_type"] == "yarn"
    assert ours == theirs
    assert (checkpoint.hf_config.max_position_embeddings
            == reference.config.max_position_embeddings)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(SETTINGS))
def test_converted_yarn_files_decode_as_transformers_past_the_original_context(
        arch, converted) -> None:
    """A 150-token prompt and 16 greedy tokens (positions to 165 of a 64-token original
    context) through the engine on the f32 file; max_model_len 256, the scaled context
    (the Llama file's context_length is 64)."""
    reference, path = converted[arch]
    llm = LLM(model=path, tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, max_model_len=4 * ORIGINAL, block_size=4,
              max_num_batched_tokens=32)
    prompt = random_prompt(150, 3)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, 16)[0]


def test_yarn_log_multiplier_reads_as_mscale_all_dim(tmp_path) -> None:
    """`yarn_log_multiplier` (mistral3's converter writes mscale_all_dim there) with mscale 1:
    llama.cpp's attention factor mscale(factor, 1) / mscale(factor, log_multiplier), which is
    transformers' with mscale 1; the file's logits past the original context are
    transformers'."""
    folder, path = str(tmp_path / "hf"), str(tmp_path / "model.gguf")
    reference = build_checkpoint("llama", folder, max_position_embeddings=ORIGINAL,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": ORIGINAL,
                                               "mscale": 1.0, "mscale_all_dim": 0.5})
    write_gguf(folder, path)
    checkpoint = open_checkpoint(resolve_model_files(path))
    assert checkpoint.reader.fields["llama.rope.scaling.yarn_log_multiplier"].contents() == 0.5
    assert rope_parameters(checkpoint.hf_config) == rope_parameters(reference.config)
    prompts = [random_prompt(150, 4), random_prompt(70, 5)]
    assert logits_error(pagoda_runner(path), reference, prompts) < 1e-4


def metadata_only_gguf(path: str, rope_fields: dict) -> str:
    """A `llama` file of metadata alone (the config is read before any tensor)."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {"vocab_size": 128, "embedding_length": 64, "feed_forward_length": 96,
                       "block_count": 1, "attention.head_count": 4, **rope_fields}.items():
        if isinstance(value, str):
            writer.add_string(f"llama.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"llama.{key}", value)
        else:
            writer.add_uint32(f"llama.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("fields, message", [
    ({"rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported .linear, yarn"),
    ({"rope.scaling.type": "yarn"}, "yarn rope scaling without llama.rope.scaling.factor"),
])
def test_rope_settings_pagoda_cannot_run_are_named(fields, message, tmp_path) -> None:
    path = metadata_only_gguf(str(tmp_path / "model.gguf"), fields)
    with pytest.raises(ModelLoadError, match=message):
        open_checkpoint(resolve_model_files(path))


def test_a_yarn_file_without_its_original_context_takes_the_context_length(tmp_path) -> None:
    """As transformers defaults original_max_position_embeddings to max_position_embeddings
    (and llama.cpp n_ctx_orig_yarn to n_ctx_train)."""
    path = metadata_only_gguf(str(tmp_path / "model.gguf"), {
        "context_length": 4096, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    params = rope_parameters(open_checkpoint(resolve_model_files(path)).hf_config)
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"]
            ) == ("yarn", 4.0, 4096)

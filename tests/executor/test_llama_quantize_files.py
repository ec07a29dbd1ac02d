"""Pagoda on GGUF files quantized by llama.cpp's own llama-quantize (built from the pinned
llama-cpp-python sdist: tests/llama_cpp_tools.py) from files its convert_hf_to_gguf.py wrote:
the types Pagoda packs as they are (Q4_K_M's mixture, Q4_0, Q8_0), every other type it
writes (requantized to Q8_0 as they are packed) and a mixed file as Unsloth's dynamic quants
mix types. (Converted files themselves: test_llama_cpp_files.py.)

Times (2 loaded cores): llama-quantize builds once into the cache (~2.5 minutes on 2 cores,
in the background while earlier tests run; skipped only where cmake or a C++ compiler is
missing, which .ci/run installs); then ~70 s, and the low-bit types ~70 s more.
"""

from __future__ import annotations

import os

import gguf
import pytest
import torch

from pagoda.executor.loader.gguf_exact_repacking import EXACT_REPACKING
from pagoda.executor.loader.gguf_packing import GGUF_FORMATS
from pagoda.executor.loader.gguf_reader import CompactGGUFReader
from pagoda.executor.loader.model_loader import weight_formats
from tests import llama_cpp_tools
from tests.executor.test_gguf_packed_models import K_SIZES, assert_same_logits, load_both
from tests.executor.test_llama_cpp_files import (
    EXACT_MAX_RELATIVE_ERROR,
    SPM_VOCAB,
    model_runner,
    spm_model,
)
from tests.executor.test_model_families import GGUF_SETTINGS, logits_error
from tests.executor.test_model_parity import PROMPTS
from tests.executor.test_quantization import relative_error
from tests.executor.tiny_checkpoints import build_checkpoint

pytestmark = pytest.mark.slow  # (make test-fast skips it)

QUANTIZE_ARCHS = ["llama", "qwen2", "gemma3"]
QUANTIZE_TYPES = {"Q4_K_M": "q4k", "Q4_0": "q4", "Q8_0": "q8"}
"""llama-quantize type -> a packed format its layers get."""
LLAMA_QUANTIZE_MAX_RELATIVE_ERROR = {"Q4_K_M": 0.35, "Q4_0": 0.4, "Q8_0": 0.03}
"""Prompt logits against the float checkpoint (a sanity bar: the exact checks are the same
file dequantized and transformers on it). Measured on the tiny random models: Q4_K_M 12-26%,
Q4_0 16-30% (Llama worst: 4-bit on N(0, 0.2) weights, compounded), Q8_0 1.3-2.2%."""
TRANSFORMERS_READS = {"llama", "qwen2"}
"""Families whose tiny GGUF transformers' own reader (gguf_file=) reads as built (its Gemma 3
reading assumes the real models' query scaling and windows)."""


@pytest.fixture(scope="module")
def k_sized(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, str, object]]:
    """arch -> (transformers model, its f32 conversion, llama-quantize): checkpoints of
    hidden 256 and intermediate 512, whole K-quant super-blocks, so that llama-quantize
    picks K-quants. llama-quantize is built into the cache on first use; skipped only where
    cmake or a C++ compiler is missing."""
    try:
        binary = llama_cpp_tools.llama_quantize()
    except llama_cpp_tools.ToolUnavailable as e:
        pytest.skip(f"llama-quantize: {e}")
    root, spm, models, jobs = tmp_path_factory.mktemp("k_sized"), spm_model(), {}, []
    for arch in QUANTIZE_ARCHS:
        folder = root / arch
        models[arch] = build_checkpoint(arch, str(folder), **{
            **GGUF_SETTINGS.get(arch, {}), **K_SIZES, "vocab_size": SPM_VOCAB,
            "bos_token_id": 1, "eos_token_id": 2})
        (folder / "tokenizer.model").write_bytes(spm)
        jobs.append((str(folder), "f32", str(root / f"{arch}-f32.gguf")))
    failures = llama_cpp_tools.convert(jobs)
    assert not failures, failures
    return {arch: (models[arch], path, binary) for arch, (_, _, path) in zip(QUANTIZE_ARCHS, jobs)}


@pytest.mark.parametrize("qtype", list(QUANTIZE_TYPES))
@pytest.mark.parametrize("arch", QUANTIZE_ARCHS)
def test_llama_quantize_files_load_packed(arch, qtype, k_sized, tmp_path) -> None:
    """llama-quantize's Q4_K_M (Q4_K, Q6_K, and Q5_0 where rows are not whole super-blocks),
    Q4_0 and Q8_0 of a converted file: packed in the default mode, equal to the same file
    dequantized, within quantization's error of the float checkpoint, and (where
    transformers reads the family's GGUF) equal to transformers on the same file."""
    reference, source, binary = k_sized[arch]
    path = str(tmp_path / f"{arch}-{qtype}.gguf")
    llama_cpp_tools.quantize(source, path, qtype, binary)
    packed_format = QUANTIZE_TYPES[qtype]
    packed, dequantized = load_both(path)
    assert packed_format in weight_formats(packed).removeprefix("packed ").split("/")
    assert_same_logits(packed, dequantized)
    runner = model_runner(packed)
    if arch in TRANSFORMERS_READS:
        from transformers import AutoModelForCausalLM

        same_file = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
        assert logits_error(runner, same_file) < 1e-3  # both float32 on the same weights
    with torch.no_grad():
        errors = [relative_error(logits, reference(torch.tensor([prompt])).logits[0])
                  for prompt, logits in zip(PROMPTS, runner.prompt_logits(PROMPTS))]
    assert max(errors) < LLAMA_QUANTIZE_MAX_RELATIVE_ERROR[qtype]


LOW_BIT_TYPES = ["Q2_K", "Q3_K_M", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
                 "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MIXED"]
"""llama-quantize's types without a packed kernel of Pagoda's own (re-encoded without loss as
Q6_K or Q8_0 where those hold their values, gguf_exact_repacking.py, else requantized to Q8_0:
gguf_packing.py), and MIXED: Q4_K_M with some matrices overridden to IQ4_XS, Q3_K, MXFP4 and
Q2_K, as Unsloth's dynamic quants mix types."""
MAIN_TYPES = {"Q3_K_M": {"Q3_K"}, "IQ2_S": {"IQ2_XS", "IQ3_S"},
              "MIXED": {"IQ4_XS", "Q3_K", "MXFP4", "Q2_K"}}
"""The types a llama-quantize type name writes into the layers (the rest: itself)."""
Q = gguf.GGMLQuantizationType
MIXED_OVERRIDES = ["attn_v=iq4_xs", "attn_output=q3_k", "ffn_up=mxfp4", "ffn_gate=q2_k"]


def uniform_imatrix(source: str, path: str) -> None:
    """An importance matrix of all ones for every 2-D weight of `source`, in the legacy
    format llama-quantize reads (int32 entries; per entry: int32 name length, name, int32
    calls, int32 values, float32 values). All ones weighs every column alike: the types that
    demand a matrix get one, with no calibration data (llama-imatrix would need a built
    llama.cpp and text; the blocks llama-quantize writes are of the same types)."""
    import struct

    reader = CompactGGUFReader(source, "r")
    entries = [(t.name, int(t.shape[0])) for t in reader.tensors
               if len(t.shape) == 2 and t.name.startswith("blk.")]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, columns in entries:
            encoded = name.encode()
            f.write(struct.pack("<i", len(encoded)) + encoded + struct.pack("<ii", 1, columns))
            f.write(struct.pack(f"<{columns}f", *([1.0] * columns)))


@pytest.mark.parametrize("qtype", LOW_BIT_TYPES)
def test_llama_quantize_low_bit_types_load_packed(qtype, k_sized, tmp_path) -> None:
    """Every other type llama-quantize writes, in a file it wrote: the file's types are
    what was asked, the default load packs every layer matrix (q6k or q8 for those a format
    holds exactly, q8 for the requantized ones) and its logits stay within Q8_0's rounding of the same file decoded exactly
    (by gguf.quants) and within the type's error of the float checkpoint."""
    reference, source, binary = k_sized["llama"]
    path = str(tmp_path / f"llama-{qtype}.gguf")
    if qtype == "MIXED":
        options = [a for override in MIXED_OVERRIDES for a in ("--tensor-type", override)]
    else:  # the i-quants demand one; every low-bit type is better for one
        uniform_imatrix(source, str(tmp_path / "imatrix.dat"))
        options = ["--imatrix", str(tmp_path / "imatrix.dat")]
    llama_cpp_tools.quantize(source, path, "Q4_K_M" if qtype == "MIXED" else qtype, binary,
                             options)
    types = {t.tensor_type.name for t in CompactGGUFReader(path, "r").tensors
             if t.name.startswith("blk.") and len(t.shape) == 2}
    assert MAIN_TYPES.get(qtype, {qtype}) <= types, types
    packed, dequantized = load_both(path)
    expected = {GGUF_FORMATS[EXACT_REPACKING.get(Q[name], Q.Q8_0)]
                for name in MAIN_TYPES.get(qtype, {qtype})}
    assert expected <= set(weight_formats(packed).removeprefix("packed ").split("/"))
    with torch.no_grad():
        float_logits = [reference(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
        requantization = [relative_error(ours, exact) for ours, exact in zip(
            model_runner(packed).prompt_logits(PROMPTS),
            model_runner(dequantized).prompt_logits(PROMPTS))]
        errors = [relative_error(logits, expected_logits) for logits, expected_logits in zip(
            model_runner(packed).prompt_logits(PROMPTS), float_logits)]
    print(qtype, sorted(types), f"requantization {max(requantization):.2e}",
          f"against float {max(errors):.4f}")
    exact = all(Q[name] in EXACT_REPACKING or Q[name] in GGUF_FORMATS for name in types)
    assert max(requantization) < (EXACT_MAX_RELATIVE_ERROR if exact else 0.05)
    if qtype in LOW_BIT_MAX_RELATIVE_ERROR:
        assert max(errors) < LOW_BIT_MAX_RELATIVE_ERROR[qtype]


LOW_BIT_MAX_RELATIVE_ERROR = {
    "Q2_K": 1.0, "Q3_K_M": 0.5, "IQ3_XXS": 0.8, "IQ3_S": 0.7, "IQ4_NL": 0.4, "IQ4_XS": 0.4,
    "IQ2_XXS": 1.2, "IQ2_XS": 1.15, "IQ2_S": 0.95, "IQ1_S": 1.35, "IQ1_M": 1.25, "MIXED": 0.6}
"""Prompt logits against the float checkpoint: a sanity bar, ~1.3x what the tiny random model
measured (2026-12-06: Q2_K 0.77, Q3_K_M 0.37, IQ3_XXS 0.62, IQ3_S 0.53, IQ4_NL 0.28, IQ4_XS
0.27, IQ2_XXS 0.91, IQ2_XS 0.88, IQ2_S 0.71, IQ1_S 1.06, IQ1_M 0.97, MIXED 0.45; an unrelated
model measures ~1.45). Not for TQ1_0/TQ2_0: ternary types on weights that are not ternary
are that far (1.45) by construction."""

"""Pagoda on GGUF files written by llama.cpp's own tools (convert_hf_to_gguf.py and
llama-quantize, from the pinned llama-cpp-python sdist: tests/llama_cpp_tools.py), not by our
tests' own writer (pagoda/executor/loader/gguf_writer.py).

Files as llama.cpp writes them differ from gguf_writer.py's in what they leave out: no
`<arch>.vocab_size` but for `llama` (llama.cpp counts `tokenizer.ggml.tokens`; a published
Gemma 3 270M failed to load on it), no sliding-window pattern, no rope base for Gemma 2,
tokenizers of their own kinds. A tiny random checkpoint of every supported family is
converted to f32 and q8_0 (Gemma 3 to f16 too); Pagoda's logits on each file (default mode:
Q8_0 packed) match transformers' on the checkpoint with its weights rounded as the file stores
them, and greedy decoding through the engine matches for the Q8_0 files of GREEDY_ARCHS.

The converter needs a tokenizer it knows: the bundled SmolLM2 tokenizer (BPE, 49152 tokens:
its pre-tokenizer hash is in the converter's table, and its token list is long enough to be
read compacted) where the converter takes a tokenizer.json, a tiny SentencePiece model
(tokenizer.model, trained here) where it wants one (Gemma 2 always; Qwen2 and Phi-3 try it
first, and under transformers 5 their tokenizer.json is rebuilt into a pre-tokenizer the
converter does not recognise).

Times (2 loaded cores): the first run fetches the sdist (pip download + unpack, 40-60 s);
then the module takes ~2.5 minutes (setup ~60 s: 13 checkpoints, 27 conversions in one
converter process). The llama-quantize tests build the binary once into the same cache
(~2.5 minutes on 2 cores; skipped only where cmake or a C++ compiler is missing, which
.ci/run installs), then take ~70 s, and the low-bit types (Q2_K to IQ1_M, a mixed file)
~70 s more.
"""

from __future__ import annotations

import io
import os
import random
import shutil

import gguf
import pytest
import torch

from pagoda.config import CacheConfig
from pagoda.executor.loader.gguf_architectures import hf_tensor_names
from pagoda.executor.loader.gguf_reader import CompactGGUFReader, array_length
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import open_checkpoint, weight_formats
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.models.registry import MODEL_REGISTRY
from tests import llama_cpp_tools
from tests.executor.test_gguf_packed_models import K_SIZES, assert_same_logits, load_both
from tests.executor.test_model_families import GGUF_SETTINGS, greedy_reference, logits_error
from tests.executor.test_model_parity import PROMPTS
from tests.executor.test_quantization import relative_error
from tests.executor.tiny_checkpoints import build_checkpoint, bundled_tokenizer

pytestmark = pytest.mark.slow  # (make test-fast skips it)

SPM_VOCAB = 384
"""The SentencePiece checkpoints' vocabulary: the tokenizer's 256 pieces, the rest padding
(the converter pads the token list to the config's vocab_size)."""
TOKENIZER = {  # arch (tiny_checkpoints.ARCHITECTURES) -> "bpe" | "glm" | "spm"
    "llama": "bpe", "llama3.1-rope": "bpe", "smollm-tied": "bpe", "mistral": "bpe",
    "mixtral": "bpe", "qwen3": "bpe", "qwen3-moe": "bpe", "olmoe": "bpe", "granite": "bpe",
    "granite-moe": "bpe", "glm4-moe": "glm", "gemma3": "bpe", "gpt-oss": "bpe",
    "qwen2": "spm", "phi3": "spm", "phi3-longrope": "spm", "gemma2": "spm", "gemma3-spm": "spm",
    "ernie4.5": "spm", "ernie4.5-moe": "spm",  # (the converter reads only tokenizer.model)
    "phimoe": "spm", "deepseek-v2": "bpe", "deepseek-v3": "bpe", "llama4": "bpe",
}
OUTTYPES = {arch: ("f32", "q8_0") for arch in TOKENIZER}
OUTTYPES["gemma3"] += ("f16",)
GREEDY_ARCHS = ["llama", "gemma2", "gemma3", "gemma3-spm", "phi3-longrope", "qwen3-moe",
                "olmoe", "granite-moe", "glm4-moe", "ernie4.5-moe", "gpt-oss", "phimoe",
                "deepseek-v2", "deepseek-v3", "llama4"]
"""Decoded end to end through the engine: the windowed, soft-capped, LongRoPE and MoE ones."""
GLM_SPECIAL_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>"]
"""Added to the bundled tokenizer for GLM's converter (it has <|endoftext|> already)."""
WRITES_VOCAB_SIZE = {"llama", "granite", "granitemoe", "deepseek2"}
"""Architectures whose converter class writes `<arch>.vocab_size` (Llama's, which Granite's
is, and DeepSeek's)."""
PUBLISHED_ARCHITECTURES = {"phimoe": "PhiMoEForCausalLM"}
"""config.json `architectures` as the published checkpoint has it (remote code), where
transformers' own class is named otherwise: llama.cpp's converter knows only that name."""
LLAMA_FILE_CLASSES = {"MistralForCausalLM": "LlamaForCausalLM"}
"""A Mistral checkpoint converts to a `llama` file (Mistral is Llama with a window)."""
Q = gguf.GGMLQuantizationType


def spm_model() -> bytes:
    """A tiny SentencePiece BPE model (as Llama 2 and Gemma ship), trained on random words."""
    import sentencepiece

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
             for _ in range(300)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=256, model_type="bpe",
        minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[dict, dict[str, str]]:
    """({arch: (the transformers model, {outtype: converted GGUF path})}, {path: the
    converter's error} of failed conversions); all converted by one converter process."""
    try:
        llama_cpp_tools.llama_cpp_source()
    except llama_cpp_tools.ToolUnavailable as e:
        # PyPI is reachable wherever Pagoda is built and tested: a missing converter is a
        # failure to see, not a reason to pass quietly
        pytest.fail(f"llama.cpp's converter is not available: {e}")
    root = tmp_path_factory.mktemp("llama_cpp")
    bpe, spm = bundled_tokenizer(), spm_model()
    glm = bundled_tokenizer()  # GLM's converter looks its special tokens up by name
    glm.add_tokens(GLM_SPECIAL_TOKENS, special_tokens=True)
    files, jobs = {}, []
    for arch, kind in TOKENIZER.items():
        folder = root / arch
        base = arch.removesuffix("-spm")
        if kind in ("bpe", "glm"):
            tokenizer = bpe if kind == "bpe" else glm
            settings = {"vocab_size": len(tokenizer), "max_position_embeddings": 2048,
                        "bos_token_id": tokenizer.bos_token_id,
                        "eos_token_id": tokenizer.eos_token_id}
        else:  # the SentencePiece model's <s> and </s>
            settings = {"vocab_size": SPM_VOCAB, "bos_token_id": 1, "eos_token_id": 2}
        model = build_checkpoint(base, str(folder), **GGUF_SETTINGS.get(base, {}), **settings)
        if base in PUBLISHED_ARCHITECTURES:
            config = folder / "config.json"
            config.write_text(config.read_text().replace(
                f'"{model.config.architectures[0]}"', f'"{PUBLISHED_ARCHITECTURES[base]}"'))
        if kind in ("bpe", "glm"):
            tokenizer.save_pretrained(str(folder))
        else:
            (folder / "tokenizer.model").write_bytes(spm)
        files[arch] = (model, {outtype: str(root / f"{arch}-{outtype}.gguf")
                               for outtype in OUTTYPES[arch]})
        jobs += [(str(folder), outtype, path) for outtype, path in files[arch][1].items()]
    return files, llama_cpp_tools.convert(jobs)


def model_runner(model: torch.nn.Module) -> ModelRunner:
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    return runner


def converted_file(converted, arch: str, outtype: str) -> tuple[torch.nn.Module, str]:
    files, failures = converted
    reference, paths = files[arch]
    if paths[outtype] in failures:
        pytest.fail(f"convert_hf_to_gguf.py --outtype {outtype} failed on {arch}:\n"
                    f"{failures[paths[outtype]]}")
    return reference, paths[outtype]


@pytest.mark.parametrize("arch", list(TOKENIZER))
def test_the_vocabulary_size_is_the_token_lists_length(arch, converted) -> None:
    """The converter writes `<arch>.vocab_size` only for WRITES_VOCAB_SIZE files: elsewhere
    the size is the token list's length, read from its header whether the reader kept the
    list (<= 1024 entries) or skipped it."""
    reference, path = converted_file(converted, arch, "f32")
    reader = CompactGGUFReader(path, "r")
    architecture = str(reader.fields["general.architecture"].contents())
    assert (f"{architecture}.vocab_size" in reader.fields) == (architecture in WRITES_VOCAB_SIZE)
    assert array_length(reader, "tokenizer.ggml.tokens") == reference.config.vocab_size
    checkpoint = open_checkpoint(resolve_model_files(path))
    assert checkpoint.hf_config.vocab_size == reference.config.vocab_size


def rounded_as_stored(folder: str, path: str, out_folder: str) -> torch.nn.Module:
    """transformers' model on the checkpoint in `folder` with each weight rounded as the
    converted file `path` stores it (F16; Q8_0 through gguf-py's quantizer, which is the
    converter's): the float32 reference for the file. (Rounding commutes with the converter's
    changes: Q8_0 blocks lie within a row, and it permutes rows and changes only 1-D norms.)"""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    checkpoint = open_checkpoint(resolve_model_files(path))
    state = load_file(os.path.join(folder, "model.safetensors"))
    rounded = set()
    for tensor in checkpoint.reader.tensors:
        if tensor.tensor_type == Q.F32:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert len(shape) >= 2, tensor.name  # (a norm would need its 1 + w rounded)
        for name in hf_tensor_names(checkpoint.family, tensor.name, shape,
                                    checkpoint.num_experts):
            if name.endswith(("k_b_proj.weight", "v_b_proj.weight")):  # DeepSeek's kv_b_proj
                round_latent_part(state, name, checkpoint.hf_config, tensor.tensor_type)
                continue
            if name not in state:  # Granite MoE's and gpt-oss's experts, stacked
                name, input_major = stacked_name(name)
                if name in rounded:
                    continue  # one stacked tensor holds both ffn_gate_exps and ffn_up_exps
                stacked = state[name].transpose(-1, -2) if input_major else state[name]
                rows = stacked.reshape(-1, stacked.shape[-1])  # Q8_0 blocks: in rows
                stacked = round_trip(rows, tensor.tensor_type).reshape(stacked.shape)
                state[name] = (stacked.transpose(-1, -2) if input_major else stacked).contiguous()
            else:
                state[name] = round_trip(state[name], tensor.tensor_type)
            rounded.add(name)
    os.makedirs(out_folder, exist_ok=True)
    shutil.copy(os.path.join(folder, "config.json"), out_folder)
    save_file(state, os.path.join(out_folder, "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(out_folder, dtype=torch.float32).eval()


def round_latent_part(state: dict, name: str, config, qtype) -> None:
    """Round DeepSeek's kv_b_proj (heads * (nope + v), rank) in `state` as the file stores
    its part `name`: k_b_proj each head's (nope, rank) block transposed (rows of nope),
    v_b_proj each head's (v, rank) block."""
    whole = f"{name.rsplit('.', 2)[0]}.kv_b_proj.weight"
    nope = config.qk_nope_head_dim
    heads = state[whole].view(config.num_attention_heads, nope + config.v_head_dim, -1)
    if "k_b_proj" in name:
        part = heads[:, :nope].transpose(1, 2)
        heads[:, :nope] = round_trip(part.reshape(-1, nope), qtype).view(part.shape).transpose(1, 2)
    else:
        part = heads[:, nope:]
        heads[:, nope:] = round_trip(part.reshape(-1, part.shape[-1]), qtype).view(part.shape)


def stacked_name(expert_name: str) -> tuple[str, bool]:
    """model.layers.{l}.<mlp>.experts.{e}.{gate,up,down}_proj.weight -> the checkpoint's
    stacked tensor of that layer holding it, and whether that tensor is input-major
    ((experts, in, out): the file's rows are its columns). Granite MoE: input_linear (gate
    and up) and output_linear, (experts, out, in); gpt-oss: gate_up_proj (gate and up
    interleaved) and down_proj, input-major."""
    prefix = expert_name.split(".experts.")[0]
    down = expert_name.endswith("down_proj.weight")
    if prefix.endswith(".block_sparse_moe"):
        return f"{prefix}.{'output' if down else 'input'}_linear.weight", False
    return f"{prefix}.experts.{'down_proj' if down else 'gate_up_proj'}", True


def round_trip(weight: torch.Tensor, qtype) -> torch.Tensor:
    if qtype == Q.F16:
        return weight.half().float()
    values = weight.float().contiguous().numpy()
    restored = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
    return torch.from_numpy(restored.reshape(values.shape).copy())


CASES = [(arch, outtype) for arch in TOKENIZER for outtype in OUTTYPES[arch]]


@pytest.mark.parametrize("arch, outtype", CASES)
def test_converted_files_match_transformers(arch, outtype, converted, tmp_path) -> None:
    """Loaded in Pagoda's default mode (Q8_0 packed), the file's logits equal transformers'
    on the checkpoint rounded as the file stores it; a quantized file's equal its own
    dequantized load (--quantization none) too."""
    reference, path = converted_file(converted, arch, outtype)
    folder = os.path.join(os.path.dirname(path), arch)
    if outtype != "f32":
        reference = rounded_as_stored(folder, path, str(tmp_path / "rounded"))
    packed, dequantized = load_both(path)
    expected = reference.config.architectures[0]
    assert type(packed) is MODEL_REGISTRY[LLAMA_FILE_CLASSES.get(expected, expected)]
    if outtype == "q8_0":
        assert "q8" in weight_formats(packed)
        assert_same_logits(packed, dequantized)
    assert logits_error(model_runner(packed), reference) < 1e-4


@pytest.mark.parametrize("arch", GREEDY_ARCHS)
def test_greedy_decoding_of_q8_0_files_matches_transformers(arch, converted, tmp_path) -> None:
    """The engine end to end on the Q8_0 file (default mode: packed), its greedy tokens
    against transformers' on the checkpoint rounded as stored (a prompt past the windows)."""
    from pagoda import LLM, SamplingParams
    from pagoda.executor.loader.model_files import bundled_model_path

    _, path = converted_file(converted, arch, "q8_0")
    reference = rounded_as_stored(os.path.join(os.path.dirname(path), arch), path,
                                  str(tmp_path / "rounded"))
    prompt = [(7 * i + 3) % 200 + 3 for i in range(24)]
    llm = LLM(model=path, tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, max_model_len=128, block_size=4)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, 8)[0]


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
"""llama-quantize's types without a packed kernel of Pagoda's own (requantized to Q8_0 as they
are packed: gguf_packing.py), and MIXED: Q4_K_M with some matrices overridden to IQ4_XS,
Q3_K, MXFP4 and Q2_K, as Unsloth's dynamic quants mix types."""
MAIN_TYPES = {"Q3_K_M": {"Q3_K"}, "IQ2_S": {"IQ2_XS", "IQ3_S"},
              "MIXED": {"IQ4_XS", "Q3_K", "MXFP4", "Q2_K"}}
"""The types a llama-quantize type name writes into the layers (the rest: itself)."""
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
    what was asked, the default load packs every layer matrix (q8 for the requantized
    types) and its logits stay within Q8_0's rounding of the same file decoded exactly
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
    assert "q8" in weight_formats(packed).removeprefix("packed ").split("/")
    with torch.no_grad():
        float_logits = [reference(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
        requantization = [relative_error(ours, exact) for ours, exact in zip(
            model_runner(packed).prompt_logits(PROMPTS),
            model_runner(dequantized).prompt_logits(PROMPTS))]
        errors = [relative_error(logits, expected_logits) for logits, expected_logits in zip(
            model_runner(packed).prompt_logits(PROMPTS), float_logits)]
    print(qtype, sorted(types), f"requantization {max(requantization):.4f}",
          f"against float {max(errors):.4f}")
    assert max(requantization) < 0.05
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


def test_gpt_oss_mxfp4_moe_file_loads(converted, tmp_path) -> None:
    """gpt-oss as its GGUF files ship: llama-quantize's MXFP4_MOE of the converted file (the
    experts MXFP4, the rest Q8_0). Packed by default (the MXFP4 experts requantized to Q8_0:
    within 5 % of the file decoded exactly, by gguf.quants) and, decoded, within MXFP4's
    error of the float checkpoint."""
    try:
        binary = llama_cpp_tools.llama_quantize()
    except llama_cpp_tools.ToolUnavailable as e:
        pytest.skip(f"llama-quantize: {e}")
    reference, source = converted_file(converted, "gpt-oss", "f32")
    path = str(tmp_path / "gpt-oss-MXFP4_MOE.gguf")
    llama_cpp_tools.quantize(source, path, "MXFP4_MOE", binary)
    types = {t.name: t.tensor_type.name for t in CompactGGUFReader(path, "r").tensors}
    assert {types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    packed, dequantized = load_both(path)
    assert "q8" in weight_formats(packed).removeprefix("packed ").split("/")
    with torch.no_grad():
        float_logits = [reference(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
        exact = model_runner(dequantized).prompt_logits(PROMPTS)
        requantization = [relative_error(ours, decoded) for ours, decoded in zip(
            model_runner(packed).prompt_logits(PROMPTS), exact)]
        errors = [relative_error(ours, expected) for ours, expected in zip(exact, float_logits)]
    print("MXFP4_MOE", f"requantization {max(requantization):.4f}",
          f"against float {max(errors):.4f}")
    assert max(requantization) < 0.05
    assert max(errors) < MXFP4_MAX_RELATIVE_ERROR


MXFP4_MAX_RELATIVE_ERROR = 0.13
"""The MXFP4_MOE file decoded exactly against the float checkpoint: a sanity bar, ~1.3x what
the tiny random model measured (2026-12-07: 0.099; the Q8_0 requantization 0.003)."""

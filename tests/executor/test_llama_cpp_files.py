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
then the module takes ~1.5 minutes (setup ~25 s: every family's checkpoint converted in one
converter process). gpt-oss's MXFP4_MOE file is llama-quantize's (built once into the same
cache); the other llama-quantize files: test_llama_quantize_files.py.
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
from pagoda.executor.loader.gguf_random_model import Shape, write_random_model
from pagoda.executor.loader.gguf_reader import CompactGGUFReader, array_length
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import open_checkpoint, weight_formats
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.models.registry import MODEL_REGISTRY
from tests import llama_cpp_tools
from tests.executor.test_gguf_packed_models import assert_same_logits, load_both
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
WRITES_VOCAB_SIZE = {"llama", "granite", "granitemoe", "llama4", "deepseek2"}
"""Architectures whose converter class writes `<arch>.vocab_size` (Llama's, which Granite's
and Llama 4's are, and DeepSeek's)."""
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


def test_gpt_oss_mxfp4_moe_file_loads(converted, tmp_path) -> None:
    """gpt-oss as its GGUF files ship: llama-quantize's MXFP4_MOE of the converted file (the
    experts MXFP4, the rest Q8_0). Packed by default (the MXFP4 experts re-encoded as Q8_0
    without loss: the file decoded exactly, by gguf.quants, to float32 rounding) and, decoded,
    within MXFP4's error of the float checkpoint."""
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
    print("MXFP4_MOE", f"requantization {max(requantization):.2e}",
          f"against float {max(errors):.4f}")
    assert max(requantization) < EXACT_MAX_RELATIVE_ERROR
    assert max(errors) < MXFP4_MAX_RELATIVE_ERROR


EXACT_MAX_RELATIVE_ERROR = 1e-4
"""A file whose every layer type packs as itself or without loss (gguf_exact_repacking.py): the packed kernels' float32
arithmetic against the file decoded to float (2026-12-08, AMX Xeon: ~1e-6; the requantized
types 8e-4 to 2e-2)."""
MXFP4_MAX_RELATIVE_ERROR = 0.13
"""The MXFP4_MOE file decoded exactly against the float checkpoint: a sanity bar, ~1.3x what
the tiny random model measured (2026-12-07: 0.099)."""


@pytest.mark.parametrize("arch", ["qwen3-moe", "olmoe", "gpt-oss"])
def test_random_weight_files_have_the_converters_layout(arch, converted, tmp_path) -> None:
    """The benchmarks' random-weight files (gguf_random_model.py, benchmarks/synthetic_gguf.py)
    of the MoE shapes measured against llama.cpp hold exactly the tensors the converter writes
    for the same shapes: names, dimensions, and the architecture's keys with their values
    (rope, context and the dense width aside: values, not shapes, and an all-MoE model's
    unused dense width, which the tiny checkpoints set otherwise than the published ones)."""
    reference, source = converted_file(converted, arch, "f32")
    config = reference.config
    family = {"qwen3-moe": "qwen3moe"}.get(arch, arch)
    shape = Shape(family, config.hidden_size, config.num_hidden_layers,
                  config.num_attention_heads, config.num_key_value_heads,
                  getattr(config, "moe_intermediate_size", config.intermediate_size),
                  tied_embeddings=config.tie_word_embeddings,
                  qkv_bias=getattr(config, "attention_bias", False),
                  experts=getattr(config, "num_experts", None) or config.num_local_experts,
                  experts_used=config.num_experts_per_tok,
                  head_dim_override=getattr(config, "head_dim", None),
                  qk_norm=family in ("qwen3moe", "olmoe"),
                  sliding_window=getattr(config, "sliding_window", None) or 0)
    ours = str(tmp_path / f"{arch}-random.gguf")
    write_random_model(arch, shape, ours, tokenizer_source=source, outtype="f32")
    layouts = [{t.name: tuple(t.shape) for t in CompactGGUFReader(path, "r").tensors}
               for path in (source, ours)]
    assert layouts[1] == layouts[0]
    fields = [CompactGGUFReader(path, "r").fields for path in (source, ours)]
    theirs = {key for key in fields[0] if key.startswith(f"{family}.")
              and not key.startswith((f"{family}.rope.", f"{family}.context_length",
                                      f"{family}.feed_forward_length"))}
    assert theirs - set(fields[1]) == set()  # every key of the architecture llama.cpp reads
    for key in theirs:
        assert fields[1][key].contents() == fields[0][key].contents(), key


@pytest.mark.parametrize("arch", ["olmoe", "deepseek-v2"])
def test_a_file_transformers_cannot_read_still_gives_its_tokenizer(arch, converted,
                                                                   monkeypatch) -> None:
    """transformers' GGUF reader refuses these architectures (AutoTokenizer reads the model
    config first); the tokenizer comes from the file's tokenizer.* keys all the same, and
    tokenizes as the bundled model's, whose vocabulary the converter copied."""
    from pagoda.executor.loader.model_files import bundled_model_path
    from pagoda.executor.loader.tokenizer import TOKENIZER_CACHE_ENV, load_tokenizer

    monkeypatch.setenv(TOKENIZER_CACHE_ENV, "")  # (built from the file, not a cached folder)
    _, path = converted_file(converted, arch, "q8_0")
    ours = load_tokenizer(resolve_model_files(path))
    bundled = load_tokenizer(resolve_model_files(bundled_model_path()))
    text = "Hello, world!<|im_start|>user\n  two spaces\tand a tab, été, 12345"
    assert ours(text).input_ids == bundled(text).input_ids
    assert (ours.bos_token, ours.eos_token) == (bundled.bos_token, bundled.eos_token)

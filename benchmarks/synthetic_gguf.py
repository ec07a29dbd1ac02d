"""Random-weight GGUF files with the shapes of the models people deploy.

Speed depends on shapes, not values: a Llama-3.2-1B-shaped file with random weights costs what
the real model costs per token. The files carry the bundled model's tokenizer (SmolLM2's BPE,
49152 tokens), so every engine can tokenize the prompts `pagoda bench` sends; the vocabulary,
and with it the embedding and output-head shapes, is therefore 49152 wide rather than the
real model's (128256 for Llama 3, 151936 for Qwen2.5). The weights are written as llama.cpp's
convert_hf_to_gguf.py writes them (its tensor names and metadata keys) in float16, ready for
llama.cpp's own `llama-quantize` (benchmarks/PEERS.md), so that both engines read the very
same quantized file.

    .venv/bin/python benchmarks/synthetic_gguf.py llama-3.2-1b /tmp/models/llama-1b-f16.gguf
    .venv/bin/python benchmarks/synthetic_gguf.py --list

Not modelled (no effect on the cost per token): Llama 3's rope-frequency scaling tensor
(`rope_freqs`), chat templates. Writing is streamed one tensor at a time: peak memory is one
float32 tensor (the embedding, 49152 x hidden), whatever the model's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shapes, as its config.json states them."""

    arch: str  # the GGUF architecture name: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry a bias
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, tied_embeddings=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, tied_embeddings=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, tied_embeddings=False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, tied_embeddings=True, qkv_bias=True,
                          rope_theta=1000000.0, rms_eps=1e-6),
}
"""The published configs' shapes (hidden size, layers, query/KV heads, FFN width)."""

WEIGHT_STD = 0.02  # transformers' initializer_range for these families
OUTTYPES = {"f16": gguf.GGMLQuantizationType.F16, "f32": gguf.GGMLQuantizationType.F32,
            "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
"""Types this script writes itself (with the gguf package's reference quantizers); K-quants
come from llama-quantize."""


def tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF tensor name, (out, in) shape) of every weight, in the converter's order."""
    kv_width = shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (vocab, shape.hidden)
    for i in range(shape.layers):
        block = f"blk.{i}"
        yield f"{block}.attn_norm.weight", (shape.hidden,)
        yield f"{block}.attn_q.weight", (shape.hidden, shape.hidden)
        yield f"{block}.attn_k.weight", (kv_width, shape.hidden)
        yield f"{block}.attn_v.weight", (kv_width, shape.hidden)
        if shape.qkv_bias:
            yield f"{block}.attn_q.bias", (shape.hidden,)
            yield f"{block}.attn_k.bias", (kv_width,)
            yield f"{block}.attn_v.bias", (kv_width,)
        yield f"{block}.attn_output.weight", (shape.hidden, shape.hidden)
        yield f"{block}.ffn_norm.weight", (shape.hidden,)
        yield f"{block}.ffn_gate.weight", (shape.ffn, shape.hidden)
        yield f"{block}.ffn_up.weight", (shape.ffn, shape.hidden)
        yield f"{block}.ffn_down.weight", (shape.hidden, shape.ffn)
    yield "output_norm.weight", (shape.hidden,)
    if not shape.tied_embeddings:
        yield "output.weight", (vocab, shape.hidden)


def parameter_count(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(dims)) for _, dims in tensors(shape, vocab))


def stored_type(name: str, dims: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    """Norms and biases stay float32 (as the converter keeps every 1-D tensor)."""
    if len(dims) == 1:
        return gguf.GGMLQuantizationType.F32
    return OUTTYPES[outtype]


def random_values(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float32 values: norms 1 (an untrained model's), everything else N(0, WEIGHT_STD)."""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    return (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float32)


def encoded(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def copy_tokenizer(source: str, writer: gguf.GGUFWriter) -> int:
    """Copies every `tokenizer.*` key of the GGUF file `source`; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub_type)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def write_metadata(writer: gguf.GGUFWriter, name: str, shape: Shape, vocab: int,
                   outtype: str) -> None:
    writer.add_name(f"random-weight {name}")
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write(name: str, shape: Shape, path: str, tokenizer_source: str, outtype: str = "f16",
          seed: int = 0) -> None:
    """Writes the random-weight model `name` with `shape` to `path` (see the module text)."""
    writer = gguf.GGUFWriter(path, shape.arch)
    vocab = copy_tokenizer(tokenizer_source, writer)
    write_metadata(writer, name, shape, vocab, outtype)
    layout = list(tensors(shape, vocab))
    for tensor_name, dims in layout:
        qtype = stored_type(tensor_name, dims, outtype)
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * type_bytes
        writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, dims in layout:
        qtype = stored_type(tensor_name, dims, outtype)
        writer.write_tensor_data(encoded(random_values(tensor_name, dims, rng), qtype))
    writer.close()


def bundled_model() -> str:
    from pagoda.executor.loader.model_files import bundled_model_path

    return bundled_model_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", nargs="?", choices=sorted(SHAPES), help="the shapes to write")
    parser.add_argument("output", nargs="?", help="the .gguf file to write")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f16",
                        help="the 2-D weights' type (K-quants: llama-quantize this file)")
    parser.add_argument("--layers", type=int, help="override the layer count (a quick file)")
    parser.add_argument("--context", type=int,
                        help="override the context length written (a long-context run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", default=None,
                        help="a GGUF file whose tokenizer to copy (default: the bundled model)")
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        vocab = 49152
        for name, shape in SHAPES.items():
            count = parameter_count(shape, vocab) / 1e9
            print(f"{name:14s} {count:5.2f}B parameters (vocab {vocab})  {shape}")
        return 0
    if not args.model or not args.output:
        parser.error("give a model (one of --list) and an output path")
    shape = SHAPES[args.model]
    if args.layers is not None:
        if args.layers < 1:
            parser.error("--layers must be at least 1")
        shape = dataclasses.replace(shape, layers=args.layers)
    if args.context is not None:
        if args.context < 1:
            parser.error("--context must be at least 1")
        shape = dataclasses.replace(shape, context=args.context)
    write(args.model, shape, args.output, args.tokenizer_from or bundled_model(),
          args.outtype, args.seed)
    print(f"wrote {args.output}: {args.model}, {shape.layers} layers, context "
          f"{shape.context}, {args.outtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

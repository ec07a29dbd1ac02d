"""Random weights with the shapes of a deployed model (`Shape`, `SHAPES`), written as a GGUF
file through gguf_writer.py's core (its metadata keys, its tensor writing), the tokenizer
copied from another GGUF file: what the speed benchmarks and the fuzzed server run (speed
depends on shapes, not values). benchmarks/synthetic_gguf.py is its command line.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagoda.executor.loader.gguf_writer import (
    Q,
    TensorSource,
    encoded,
    write_core_metadata,
    write_tensors,
)


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shapes, as its config.json states them."""

    arch: str  # the GGUF architecture name: "llama", "qwen2", "qwen3moe", "olmoe", "gpt-oss"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # the dense MLP's width; a MoE model's each expert's
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry a bias
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 8192
    experts: int = 0  # a sparse MoE MLP in every layer: this many experts (0: dense)
    experts_used: int = 0  # chosen a token
    head_dim_override: int | None = None  # where it is not hidden / heads (Qwen3)
    qk_norm: bool = False  # RMSNorms of q and k: per head (Qwen3), over all heads (OLMoE)
    sliding_window: int = 0  # gpt-oss: every other layer's window, from the first

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, tied_embeddings=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, tied_embeddings=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, tied_embeddings=False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, tied_embeddings=True, qkv_bias=True,
                          rope_theta=1000000.0, rms_eps=1e-6),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 768, tied_embeddings=False,
                           rope_theta=1000000.0, rms_eps=1e-6, experts=128, experts_used=8,
                           head_dim_override=128, qk_norm=True),
    "olmoe-1b-7b": Shape("olmoe", 2048, 16, 16, 16, 1024, tied_embeddings=False,
                         rope_theta=10000.0, context=4096, experts=64, experts_used=8,
                         qk_norm=True),
    # gpt-oss-20b: biased attention with sinks, every other layer a 128-token window, a biased
    # router and biased experts (its YaRN scaling, a value not a shape, is left out)
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 2880, tied_embeddings=False,
                         qkv_bias=True, rope_theta=150000.0, context=131072, experts=32,
                         experts_used=4, head_dim_override=64, sliding_window=128),
}
"""The published configs' shapes (hidden size, layers, query/KV heads, FFN width)."""

WEIGHT_STD = 0.02  # transformers' initializer_range for these families
OUTTYPES = {"f16": Q.F16, "f32": Q.F32, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
"""Types `write_random_model` writes itself (with the gguf package's reference quantizers);
K-quants come from llama.cpp's llama-quantize."""
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


def shape_tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF tensor name, (out, in) shape) of every weight, in the converter's order."""
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gpt_oss = shape.arch == "gpt-oss"
    yield "token_embd.weight", (vocab, shape.hidden)
    for i in range(shape.layers):
        block = f"blk.{i}"
        yield f"{block}.attn_norm.weight", (shape.hidden,)
        yield f"{block}.attn_q.weight", (q_width, shape.hidden)
        yield f"{block}.attn_k.weight", (kv_width, shape.hidden)
        yield f"{block}.attn_v.weight", (kv_width, shape.hidden)
        if shape.qkv_bias:
            yield f"{block}.attn_q.bias", (q_width,)
            yield f"{block}.attn_k.bias", (kv_width,)
            yield f"{block}.attn_v.bias", (kv_width,)
        yield f"{block}.attn_output.weight", (shape.hidden, q_width)
        if gpt_oss:
            yield f"{block}.attn_output.bias", (shape.hidden,)
            yield f"{block}.attn_sinks.weight", (shape.heads,)
        if shape.qk_norm:  # OLMoE's over the whole projection, Qwen3's per head
            whole = shape.arch == "olmoe"
            yield f"{block}.attn_q_norm.weight", (q_width if whole else shape.head_dim,)
            yield f"{block}.attn_k_norm.weight", (kv_width if whole else shape.head_dim,)
        yield f"{block}.{'post_attention_norm' if gpt_oss else 'ffn_norm'}.weight", (shape.hidden,)
        if shape.experts:  # the router, then each projection's experts stacked
            yield f"{block}.ffn_gate_inp.weight", (shape.experts, shape.hidden)
            if gpt_oss:
                yield f"{block}.ffn_gate_inp.bias", (shape.experts,)
            for projection, rows, columns in (("gate", shape.ffn, shape.hidden),
                                              ("up", shape.ffn, shape.hidden),
                                              ("down", shape.hidden, shape.ffn)):
                yield f"{block}.ffn_{projection}_exps.weight", (shape.experts, rows, columns)
                if gpt_oss:  # one bias row per expert
                    yield f"{block}.ffn_{projection}_exps.bias", (shape.experts, rows)
            continue
        yield f"{block}.ffn_gate.weight", (shape.ffn, shape.hidden)
        yield f"{block}.ffn_up.weight", (shape.ffn, shape.hidden)
        yield f"{block}.ffn_down.weight", (shape.hidden, shape.ffn)
    yield "output_norm.weight", (shape.hidden,)
    if not shape.tied_embeddings:
        yield "output.weight", (vocab, shape.hidden)


def parameter_count(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(dims)) for _, dims in shape_tensors(shape, vocab))


def stored_type(name: str, dims: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    """Norms, biases and routers stay float32 (as the converter keeps every 1-D tensor, and
    llama-quantize every router)."""
    return (Q.F32 if len(dims) == 1 or name.endswith(("ffn_gate_inp.weight", ".bias"))
            else OUTTYPES[outtype])


def random_values(name: str, dims: tuple[int, ...], rng: torch.Generator) -> np.ndarray:
    """float32 values: norms 1 (an untrained model's), everything else N(0, WEIGHT_STD).
    (torch's normal sampler: ~4x numpy's on a 1B model's embedding.)"""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    return (torch.randn(dims, generator=rng) * WEIGHT_STD).numpy()


def copy_tokenizer(source: str, writer: gguf.GGUFWriter) -> int:
    """Copies every `tokenizer.*` key of the GGUF file `source`; returns the vocabulary size."""
    fields = tokenizer_fields(source)
    for key, value, kind, sub_type in fields:
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    vocab = next((len(value) for key, value, *_ in fields if key == "tokenizer.ggml.tokens"), 0)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def tokenizer_fields(source: str) -> tuple[tuple, ...]:
    """(key, value, type, array item type) of each `tokenizer.*` key of the GGUF file."""
    stat = os.stat(source)
    return _tokenizer_fields(os.path.abspath(source), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str, mtime_ns: int, size: int) -> tuple[tuple, ...]:
    """tokenizer_fields, read once per version of the file (GGUFReader parses a 49k-token
    vocabulary's arrays in ~4 s). Callers never change the values."""
    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), kind, sub_type))
    return tuple(fields)


def write_random_model(name: str, shape: Shape, path: str, tokenizer_source: str,
                       outtype: str = "f16", seed: int = 0) -> None:
    """Writes random weights with `shape` to `path`, named "random-weight {name}", with the
    tokenizer of the GGUF file `tokenizer_source`. Values are drawn in file order from one
    generator seeded `seed`, as each tensor is written."""
    writer = gguf.GGUFWriter(path, shape.arch)
    vocab = copy_tokenizer(tokenizer_source, writer)
    writer.add_name(f"random-weight {name}")
    write_core_metadata(writer, vocab=vocab, context=shape.context, hidden=shape.hidden,
                        layers=shape.layers, ffn=shape.ffn, heads=shape.heads,
                        kv_heads=shape.kv_heads, rms_eps=shape.rms_eps,
                        rope_theta=shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim_override:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(FILE_TYPES[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rng = torch.Generator().manual_seed(seed)

    def source(tensor_name: str, dims: tuple[int, ...]) -> TensorSource:
        qtype = stored_type(tensor_name, dims, outtype)
        return (tensor_name, dims, qtype,
                lambda: encoded(random_values(tensor_name, dims, rng), qtype))

    write_tensors(writer, [source(n, d) for n, d in shape_tensors(shape, vocab)])

"""`--deterministic`: batch-invariant execution, so that an identical request gives
bit-identical logits whatever batch it lands in, however its prompt is chunked and whatever
the prefix cache holds.

Why the default mode cannot promise it: a token's numbers pass through kernels whose
summation order depends on the step's shape. The packed matmul decodes a weight tile once
for up to 4 rows and keeps 1, 2 or 4 accumulator chains depending on how many rows share it;
from 128 rows it multiplies by a dequantized weight through BLAS, which blocks by the whole
shape; torch's RMSNorm and SiLU take another path for the tail of a range; attention over a
cold prompt is one masked scaled_dot_product_attention, over a cache hit the kernel. Each
changes the last bits, and a near-tie of the logits can turn the greedy token.

In this mode every per-token computation is done on its own, in one fixed order:
    - linears: the packed kernels' one-row tiles (`gemm_packed(rowwise=True)`, gemm_q's twin)
      at every row count; float weights one row at a time (`linear_rows`), logits head too;
    - RMSNorm and SiLU-and-mul: the C kernels, a row at a time;
    - attention: every token, prefill or decode, one query of the paged kernel against its
      own causal prefix (cpu_backend.KernelTokenGroup);
    - no whole-stack decode step (its matmuls share tiles across the batch's rows): a
      batch-invariant ModelRunner runs every step eager.
Everything else a layer does is elementwise IEEE arithmetic (adds, the rotary's products)
or a lookup, the same bits at any shape. The sampler ranks each row of float32 logits alone.

What it covers: the Llama family's blocks (Llama, Mistral, Qwen2/3, Phi-3, SmolLM) with
float, packed (GGUF) or Pagoda-quantized weights, float32 activations and KV cache, on CPU
with the C kernels. Anything else is refused with the reason (ValueError).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.attention.layer import Attention
from pagoda.executor.kernels.ops import kernels_available
from pagoda.executor.layers.activation import SiluAndMul
from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.layers.packed_linear import PackedEmbedding, PackedLinear
from pagoda.executor.layers.rotary import RotaryEmbedding
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

SWITCHED = (Linear, PackedLinear, RMSNorm, SiluAndMul)
"""Layers with a `batch_invariant` switch."""
STRUCTURAL = (LlamaModel, LlamaDecoderLayer, LlamaAttention, LlamaMLP, RotaryEmbedding,
              Attention, nn.ModuleList, nn.Embedding, PackedEmbedding)
"""Modules (exactly these types) that only compose their children with elementwise
arithmetic or look rows up."""


def make_batch_invariant(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Switch every layer of `model` to its batch-invariant path; ValueError naming what the
    mode does not cover, before anything is switched."""
    if device.type != "cpu" or dtype != torch.float32 or not kernels_available(torch.float32):
        raise ValueError(f"--deterministic runs float32 on CPU with Pagoda's C kernels; this "
                         f"engine runs {dtype} on {device}"
                         + ("" if kernels_available(torch.float32) else " without the kernels"))
    uncovered = sorted({type(module).__name__ for module in model.modules()
                        if not _covered(module)})
    if uncovered:
        raise ValueError(f"--deterministic covers the Llama family's blocks (Llama, Mistral, "
                         f"Qwen2/3, Phi-3, SmolLM); this model has {', '.join(uncovered)}")
    for module in model.modules():
        if isinstance(module, (*SWITCHED, LlamaForCausalLM)):
            module.batch_invariant = True


def _covered(module: nn.Module) -> bool:
    if isinstance(module, LlamaForCausalLM):
        return module.final_logit_softcap is None
    if isinstance(module, PackedLinear):  # float32 on the packed weight alone
        return bool(module.segments) and module.takes_float32
    if isinstance(module, Attention):
        return module.logit_softcap is None and module.sinks is None
    return isinstance(module, SWITCHED) or type(module) in STRUCTURAL

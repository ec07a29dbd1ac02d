"""Cut a loaded Llama-family model down to one tensor-parallel rank's share, in place.

Per decoder layer (H query heads, K KV heads, head_dim D, intermediate I; partition.py says
which heads and rows rank r holds):

    qkv_proj     rows [q heads of r | k heads of r | v heads of r]       column-parallel
    o_proj       input columns of r's q heads, bias on rank 0            row-parallel, all-reduce
    gate_up_proj rows [gate rows of r | up rows of r]                    column-parallel
    down_proj    input columns of r's rows, bias on rank 0               row-parallel, all-reduce
    sparse MoE   every expert (and the shared one) cut as an MLP is,      one all-reduce of
                 the router whole: every rank routes alike                the block's output
    attention    r's heads only: its KV cache holds r's KV heads (and its sinks, r's heads');
                 DeepSeek's latent attention: r's query heads, the one latent head whole
    embedding    vocabulary rows of r, lookup + all-reduce
    logits head  vocabulary rows of r (the embedding's when tied), all-gather

Norms and the rotary tables stay whole (every rank holds the whole hidden state), but for
OLMoE's q/k norms over all heads: each rank's features, the squares all-reduced. The model
is loaded whole first, by any loader, then cut: each rank briefly holds the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.layers.moe import SparseMoeBlock
from pagoda.executor.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    LatentAttention,
    LatentUpProjection,
)
from pagoda.executor.models.ernie import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM
from pagoda.executor.models.gpt_oss import GptOssForCausalLM
from pagoda.executor.models.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from pagoda.executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    head_dim_of,
)
from pagoda.executor.models.llama4 import Llama4ForCausalLM
from pagoda.executor.models.mixtral import (
    Glm4MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeAttention,
    OlmoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from pagoda.executor.models.phimoe import PhimoeForCausalLM
from pagoda.executor.parallel.communication import TensorParallelGroup
from pagoda.executor.parallel.layers import (
    RowParallelLinear,
    ShardedRMSNorm,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from pagoda.executor.parallel.partition import HeadShare, aligned_runs, even_runs, head_shares
from pagoda.executor.parallel.slicing import (
    column_align,
    embedding_rows,
    linear_columns,
    linear_rows,
    row_align,
)

SHARDABLE_MODELS = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                    Phi3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM,
                    Glm4MoeForCausalLM, Llama4ForCausalLM, GptOssForCausalLM,
                    GraniteForCausalLM, GraniteMoeForCausalLM, Ernie4_5ForCausalLM,
                    Ernie4_5_MoeForCausalLM, PhimoeForCausalLM, OlmoeForCausalLM,
                    DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)
"""Exactly these classes: the Llama family (Granite's multipliers and ERNIE's rotary row
order are per element or per head) and the MoE models on its attention whose experts are
SwiGLU MLPs (Llama 4's per-head q/k norms and query temperature and gpt-oss's sinks split with
the heads, gpt-oss's expert biases with the rows, the down projections' on rank 0, OLMoE's
q/k norms over all heads with their squares summed over the ranks, DeepSeek's latent
attention by query heads around the one latent every rank caches; Gemma's norms and
soft-capping are not split)."""


def check_shardable(model_class: type, config, world_size: int) -> None:
    """ValueError, before any work, where tensor parallelism cannot split this model."""
    if model_class not in SHARDABLE_MODELS:
        raise ValueError(
            f"tensor parallelism supports the Llama family ("
            f"{', '.join(c.__name__ for c in SHARDABLE_MODELS)}), not {model_class.__name__}")
    head_shares(config.num_attention_heads, config.num_key_value_heads, world_size)


def shard_model(model: nn.Module, group: TensorParallelGroup) -> nn.Module:
    """Keep rank `group.rank`'s share of `model` (loaded whole), wired with the collectives
    that make its outputs whole. Returns the model, changed in place."""
    config = model.config
    check_shardable(type(model), config, group.world_size)
    shares = head_shares(config.num_attention_heads, config.num_key_value_heads,
                         group.world_size)
    share = shares[group.rank]
    head_dim = head_dim_of(config)
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        if isinstance(layer.self_attn, LatentAttention):
            _shard_latent_attention(layer.self_attn, group)
            _shard_mlp(getattr(layer, layer.mlp_name), group)
            continue
        _shard_attention(layer.self_attn, share, head_dim, config, group)
        if isinstance(layer.self_attn, OlmoeAttention):
            _shard_whole_width_norms(layer.self_attn, shares, group)
        _shard_mlp(getattr(layer, layer.mlp_name), group)
    _shard_vocabulary(model, group)
    model.tensor_parallel_group = group
    return model


def _shard_attention(attention: LlamaAttention, share: HeadShare, head_dim: int, config,
                     group: TensorParallelGroup) -> None:
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    q_rows = (share.q_start * head_dim, share.q_stop * head_dim)
    k_rows = (q_size + share.kv_start * head_dim, q_size + share.kv_stop * head_dim)
    v_rows = (q_size + kv_size + share.kv_start * head_dim,
              q_size + kv_size + share.kv_stop * head_dim)
    _check_grid(attention.qkv_proj, [*q_rows, *k_rows, *v_rows], row_align, "qkv_proj rows")
    _check_grid(attention.o_proj, q_rows, column_align, "o_proj inputs")
    attention.qkv_proj = linear_rows(attention.qkv_proj, [q_rows, k_rows, v_rows])
    # each part's own rows (q, k, v), for LoRA adapters (executor/lora/model_lora.py)
    attention.qkv_proj.shard_rows = (q_rows, (k_rows[0] - q_size, k_rows[1] - q_size),
                                     (v_rows[0] - q_size - kv_size, v_rows[1] - q_size - kv_size))
    attention.o_proj = RowParallelLinear(
        linear_columns(attention.o_proj, *q_rows, keep_bias=group.rank == 0), group,
        columns=q_rows, whole_in_features=q_size)
    attention.num_heads, attention.num_kv_heads = share.num_heads, share.num_kv_heads
    attention.attn.num_heads, attention.attn.num_kv_heads = share.num_heads, share.num_kv_heads
    if attention.attn.sinks is not None:  # gpt-oss: a sink logit per query head, r's heads'
        attention.attn.sinks = nn.Parameter(
            attention.attn.sinks[share.q_start:share.q_stop].clone(), requires_grad=False)
    local_q, local_kv = share.num_heads * head_dim, share.num_kv_heads * head_dim
    attention.qk_v_sizes = [local_q + local_kv, local_kv]


def _shard_latent_attention(attention: LatentAttention, group: TensorParallelGroup) -> None:
    """DeepSeek's MLA: rank r's query heads (their q rows, their part of kv_b_proj, their
    o_proj inputs, all-reduced); the latent's projection and norm whole, so every rank caches
    the same one latent head and attends to it with its own heads."""
    start, stop = even_runs(attention.num_heads, group.world_size)[group.rank]
    q_name = "q_b_proj" if attention.q_lora_rank else "q_proj"
    q_head = attention.nope_dim + attention.rope_dim
    q_rows = (start * q_head, stop * q_head)
    o_columns = (start * attention.v_dim, stop * attention.v_dim)
    _check_grid(getattr(attention, q_name), q_rows, row_align, f"{q_name} rows")
    _check_grid(attention.o_proj, o_columns, column_align, "o_proj inputs")
    setattr(attention, q_name, linear_rows(getattr(attention, q_name), [q_rows]))
    attention.o_proj = RowParallelLinear(
        linear_columns(attention.o_proj, *o_columns, keep_bias=group.rank == 0), group,
        columns=o_columns, whole_in_features=attention.num_heads * attention.v_dim)
    whole = attention.kv_b_proj
    local = LatentUpProjection(stop - start, whole.nope_dim, whole.v_dim, whole.rank)
    local.weight.data = whole.weight.view(whole.num_heads, -1, whole.rank)[start:stop] \
        .reshape(-1, whole.rank).clone()
    attention.kv_b_proj = local
    attention.num_heads = attention.attn.num_heads = stop - start


def _shard_whole_width_norms(attention: OlmoeAttention, shares: list[HeadShare],
                             group: TensorParallelGroup) -> None:
    """OLMoE's q and k RMSNorms span all heads: each rank keeps its heads' features of the
    weights and sums the squares over the ranks (ShardedRMSNorm)."""
    head_dim, share = attention.head_dim, shares[group.rank]
    for name, start, stop, counted in (
            ("q_norm", share.q_start, share.q_stop, sum(s.q_stop - s.q_start for s in shares)),
            ("k_norm", share.kv_start, share.kv_stop,
             sum(s.kv_stop - s.kv_start for s in shares))):
        norm = getattr(attention, name)
        setattr(attention, name, ShardedRMSNorm(
            norm.weight[start * head_dim:stop * head_dim], norm.eps, counted * head_dim, group))
    attention.q_size = share.num_heads * head_dim
    attention.kv_size = share.num_kv_heads * head_dim


def _shard_mlp(mlp: nn.Module, group: TensorParallelGroup) -> None:
    if isinstance(mlp, SparseMoeBlock):
        shared = [] if mlp.shared_experts is None else [mlp.shared_experts]
        for expert in [*mlp.experts, *shared]:
            _shard_swiglu(expert, group, reduce=False)
        mlp.tensor_parallel_group = group  # (the block sums its output over ranks once)
        return
    if not isinstance(mlp, LlamaMLP):
        raise ValueError(f"tensor parallelism cannot split a {type(mlp).__name__} MLP")  # noqa: TRY004
    _shard_swiglu(mlp, group, reduce=True)


def _shard_swiglu(mlp: nn.Module, group: TensorParallelGroup, reduce: bool) -> None:
    """A SwiGLU MLP (LlamaMLP: gate_up_proj, down_proj; a Mixtral expert: w13, w2) down to
    rank r's intermediate rows; its down projection all-reduced where `reduce` (an expert's
    partial output is summed with the whole block's instead)."""
    up_name, down_name = ("w13", "w2") if hasattr(mlp, "w13") else ("gate_up_proj", "down_proj")
    up, down = getattr(mlp, up_name), getattr(mlp, down_name)
    intermediate = down.in_features
    align = max(row_align(up), column_align(down))
    start, stop = aligned_runs(intermediate, group.world_size, align)[group.rank]
    new_up = linear_rows(up, [(start, stop), (intermediate + start, intermediate + stop)])
    new_up.shard_rows = ((start, stop), (start, stop))  # gate's, up's own rows
    new_down = linear_columns(down, start, stop, keep_bias=group.rank == 0)
    if reduce:
        new_down = RowParallelLinear(new_down, group, columns=(start, stop),
                                     whole_in_features=intermediate)
    setattr(mlp, up_name, new_up)
    setattr(mlp, down_name, new_down)


def _shard_vocabulary(model: LlamaForCausalLM, group: TensorParallelGroup) -> None:
    """The embedding and the logits head, both split by vocabulary rows on one grid."""
    # the head's weight: a quantized one stands in for the float lm_head (None: tied, float)
    head = model.quantized_head if model.quantized_head is not None else model.lm_head
    vocab_size = model.config.vocab_size
    embedding = model.model.embed_tokens
    align = max(row_align(head) if head is not None else 1, _embedding_align(embedding))
    runs = aligned_runs(vocab_size, group.world_size, align)
    start, stop = runs[group.rank]
    group.last_dim_sizes = tuple(b - a for a, b in runs)
    model.model.embed_tokens = VocabParallelEmbedding(embedding_rows(embedding, start, stop),
                                                      start, group)
    if head is not None:
        local_head = linear_rows(head, [(start, stop)])
    else:  # tied, float: the embedding's rows are the head's
        local_head = _TiedHead(model.model.embed_tokens.inner.weight)
    model.quantized_head = VocabParallelHead(local_head, group)
    if model.lm_head is not None:
        model.lm_head = None  # (its whole weight goes; head_logits uses quantized_head)


def _embedding_align(embedding: nn.Module) -> int:
    return 1 if isinstance(embedding, nn.Embedding) else 16


def _check_grid(module: nn.Module, bounds, align_of, what: str) -> None:
    align = align_of(module)
    if any(bound % align for bound in bounds):
        raise ValueError(
            f"tensor parallelism cannot split {what} at {list(bounds)}: this layer's weight "
            f"is held in blocks of {align}; use a smaller tensor_parallel_size or "
            f"--quantization none")


class _TiedHead(nn.Module):
    """Logits from a float table shared with the embedding: hidden (n, d) -> (n, rows)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

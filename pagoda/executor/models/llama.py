"""The Llama family: Llama 2/3/3.1, SmolLM, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
Phi-3 (q/k/v and gate/up already fused in the checkpoint).

Parameter names follow the Hugging Face checkpoints; q/k/v and gate/up are fused into one
matmul each and filled part by part by their weight loaders (or whole, where the checkpoint
stores them fused). Inputs are flat over the batch: every scheduled token of every sequence
in one (num_tokens,) row. The blocks here are shared by the other families (gemma.py,
mixtral.py), which swap in their own MLP, norms or attention settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.executor.attention.layer import Attention
from pagoda.executor.forward_context import get_forward_context
from pagoda.executor.layers.activation import gated_activation
from pagoda.executor.layers.linear import (
    Linear,
    MergedLinear,
    default_weight_loader,
    linear_rows,
)
from pagoda.executor.layers.norm import RMSNorm
from pagoda.executor.layers.rotary import RotaryEmbedding
from pagoda.executor.loader.gguf_architectures import unpermute_rotary

# (fused parameter, checkpoint part, shard id)
STACKED_PARAMS = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Gemma's settings come in as keywords: `scale` (default head_dim ** -0.5), a per-layer
    `sliding_window`, `logit_softcap`, `o_bias` and the class of the q/k norms; gpt-oss's
    `sinks`, Llama 4's `chunk` (attention/layer.py)."""

    def __init__(
        self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, *,
        scale: float | None = None, sliding_window: int | None = None,
        logit_softcap: float | None = None, o_bias: bool = False, norm_class: type = RMSNorm,
        sinks: bool = False, chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = norm_class(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_class(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, chunk=chunk,
        )
        self.qk_v_sizes = [q_size + kv_size, kv_size]  # q and k heads are rotated together

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split(self.qk_v_sizes, dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused: gate_up_proj rows [gate | up]."""

    def __init__(
        self, config, intermediate_size: int | None = None, activation: str | None = None
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {0: size, 1: size})
        self.down_proj = Linear(size, config.hidden_size)
        self.act = gated_activation(activation or getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """`attention` (a LlamaAttention or a family's own) and `mlp`, built by LlamaModel;
    `mlp_name`: the MLP's name in the checkpoint ("mlp"; Mixtral's "block_sparse_moe");
    `norm_class`: the two norms' (RMSNorm; PhiMoE's LayerNorm)."""

    def __init__(
        self, config, attention: nn.Module, mlp: nn.Module, mlp_name: str = "mlp",
        norm_class: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


def unfilled_embedding(config) -> nn.Embedding:
    """The token embedding, allocated but not initialised: the checkpoint fills it, so no
    page is touched before loading."""
    embedding = nn.Embedding(config.vocab_size, config.hidden_size,
                             _weight=torch.empty(config.vocab_size, config.hidden_size))
    embedding.weight.requires_grad_(False)
    return embedding


class LlamaModel(nn.Module):
    """`make_mlp(layer_index)`: each layer's MLP (a LlamaMLP unless a family says otherwise:
    mixture-of-experts layers), named `mlp_name` in the checkpoint; `attention_class`: the
    layers' attention (a LlamaAttention subclass: OLMoE's, Granite's), or
    `make_attention(layer_index, rotary)` where layers differ (gpt-oss's windows, Llama 4's
    rotary and chunked layers); `norm_class`: every norm's, the final one's included
    (RMSNorm; PhiMoE's LayerNorm)."""

    def __init__(
        self, config, qkv_bias: bool, qk_norm: bool, max_position: int, make_mlp=None,
        mlp_name: str = "mlp", attention_class: type[LlamaAttention] = LlamaAttention,
        norm_class: type[nn.Module] = RMSNorm, make_attention=None,
    ) -> None:
        super().__init__()
        self.embed_tokens = unfilled_embedding(config)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.rotary = rotary
        make_mlp = make_mlp or (lambda index: LlamaMLP(config))
        make_attention = make_attention or (
            lambda index, rotary: attention_class(config, rotary, qkv_bias, qk_norm))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, make_attention(index, rotary), make_mlp(index), mlp_name,
                              norm_class)
            for index in range(config.num_hidden_layers)
        )
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input's token embeddings (Granite scales them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False
    qk_norm = False
    stacked_params = STACKED_PARAMS
    """(fused parameter, checkpoint part, shard id): checkpoint tensors loaded into a part."""
    final_logit_softcap: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma 2)."""
    batch_invariant = False
    """Set by executor/batch_invariant.py: a float head multiplies a row at a time."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:  # (a bias where the config says so: PhiMoE)
            self.lm_head = Linear(config.hidden_size, config.vocab_size,
                                  bias=bool(getattr(config, "lm_head_bias", False)))
        # Set by quantize_linear_layers (--quantization): a QuantizedLinear over the head's
        # weight, used in place of it; the embedding keeps its float table for lookups.
        self.quantized_head: nn.Module | None = None

    def build_model(self, config, max_position: int) -> nn.Module:
        """The decoder stack (`self.model`): embedding, layers, final norm."""
        qkv_bias = bool(getattr(config, "attention_bias", self.qkv_bias_default))
        return LlamaModel(config, qkv_bias, self.qk_norm, max_position)

    @property
    def sliding_window(self) -> int | None:
        """The window of every layer (the backend's); None where there is none, or where
        layers bring their own (Gemma)."""
        return getattr(self.config, "sliding_window", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (num_tokens,) -> hidden states (num_tokens, hidden_size)."""
        get_forward_context()  # fail early and clearly when called outside a step
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden_size) -> float32 logits (n, vocab_size)."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden_size) -> logits (n, vocab_size), float32 wherever the head's
        weights allow it cheaply: a packed or Pagoda-quantized head takes float32 rows (its
        C matmuls accumulate and write float32), so bf16 activations never round the logits
        the sampler ranks (bf16 logits make exact ties: the bundled model's first answer
        token was one). A float head runs in the model's dtype (the sampler converts).

        `quantized_head`, when set, stands in for the head's float weight (and bias)."""
        if self.quantized_head is not None:
            takes_float32 = getattr(self.quantized_head, "takes_float32", False)
            logits = self.quantized_head(hidden.float() if takes_float32 else hidden)
        elif self.batch_invariant:
            logits = linear_rows(hidden, self.logits_head_weight(), self.logits_head_bias())
        else:
            logits = torch.nn.functional.linear(hidden, self.logits_head_weight(),
                                                self.logits_head_bias())
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def logits_head_weight(self) -> torch.Tensor:
        """(vocab_size, hidden_size): the lm_head's weight, or the embedding table when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits_head_bias(self) -> torch.Tensor | None:
        """(vocab_size,): the lm_head's bias where it has one (PhiMoE), else None."""
        return None if self.lm_head is None else self.lm_head.bias

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Raises ValueError for a tensor the model has no place for, and for a parameter that no
        tensor filled."""
        params = dict(self.named_parameters())
        filled: dict[str, set] = {}
        for name, tensor in weights:
            if name == "rope_freq_factors":
                self.model.rotary.apply_freq_factors(tensor)
                continue
            if "rotary_emb.inv_freq" in name:
                continue  # some checkpoints store the (recomputed) rotary buffer
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied embeddings: some checkpoints still store a copy
            for fused, part, shard_id in self.stacked_params:
                if part in name:
                    target = name.replace(part, fused)
                    self._param(params, target).weight_loader(params[target], tensor, shard_id)
                    filled.setdefault(target, set()).add(shard_id)
                    break
            else:
                param = self._param(params, name)
                shards = getattr(self._owner(name), "shard_offsets", None)
                if shards is not None:  # a fused projection stored fused (Phi-3): every part
                    param.weight_loader(param, tensor, None)
                    filled.setdefault(name, set()).update(shards)
                    continue
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                filled.setdefault(name, set())
        missing = sorted(set(params) - set(filled))
        if missing:
            raise ValueError(f"checkpoint has no weights for: {', '.join(missing[:8])}")
        for name, shards in filled.items():
            expected = getattr(self._owner(name), "shard_offsets", None)
            if expected is not None and shards != set(expected):
                raise ValueError(f"checkpoint lacks parts {set(expected) - shards} of {name}")

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    @staticmethod
    def _param(params: dict, name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        return params[name]


class MistralForCausalLM(LlamaForCausalLM):
    """Same blocks as Llama; sliding-window attention comes from config.sliding_window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama blocks with a bias on the q/k/v projections."""

    qkv_bias_default = True

    def __init__(self, config, max_position: int) -> None:
        config.attention_bias = True
        super().__init__(config, max_position)

    @property
    def sliding_window(self) -> int | None:
        if getattr(self.config, "use_sliding_window", False):
            return self.config.sliding_window
        return None


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama blocks with RMSNorm over each head of q and k before the rotary."""

    qk_norm = True

    @property
    def sliding_window(self) -> int | None:
        if getattr(self.config, "use_sliding_window", False):
            return self.config.sliding_window
        return None


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama blocks; the checkpoint stores qkv_proj and gate_up_proj fused, in Pagoda's
    layout ([q | k | v] and [gate | up] rows), so they load whole. Phi-3.5 / Phi-4-mini bring
    longrope scaling and partial rotary (layers/rotary.py)."""


def half_rotary(weights: Iterable[tuple[str, torch.Tensor]], config
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """q and k rows (weights and biases) from a pairwise rotary layout (each head's rows
    (x0, x1), (x2, x3), ... turn together: ERNIE's, Meta's Llama 4) to the halves layout
    Pagoda's rotary takes; the same pairs then turn, and q . k is unchanged."""
    for name, tensor in weights:
        if ".self_attn.q_proj." in name:
            tensor = unpermute_rotary(tensor, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            tensor = unpermute_rotary(tensor, config.num_key_value_heads)
        yield name, tensor

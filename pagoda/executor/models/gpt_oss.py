"""OpenAI's gpt-oss (GptOssForCausalLM): Llama blocks with

- attention with a bias on q/k/v and o, a learned sink logit per head (`self_attn.sinks`,
  attention/torch_backend.py), and sliding-window ("sliding_attention") layers interleaved
  with global ones by `config.layer_types`;
- YaRN rotary (rope_scaling.py; `truncate` false);
- every layer a sparse MoE: a router with a bias, top-k of its logits then softmax over
  them (SparseMoeBlock's softmax_after_top_k), experts with biased projections and a
  clamped SwiGLU (layers/activation.py: ClampedSwigluAndMul).

The checkpoint stores each layer's experts as stacked tensors, input-major:

    mlp.experts.gate_up_proj       (E, hidden, 2 * I)  columns interleaved: gate, up, gate, ...
    mlp.experts.gate_up_proj_bias  (E, 2 * I)          interleaved alike
    mlp.experts.down_proj          (E, I, hidden)
    mlp.experts.down_proj_bias     (E, hidden)
    mlp.router.weight / .bias      (E, hidden) / (E,)  -> mlp.gate

`load_weights` splits them into experts.{e}.gate_up_proj ([gate | up] rows, Pagoda's
MergedLinear layout) and experts.{e}.down_proj. OpenAI's published checkpoints
(quantization_config.quant_method "mxfp4") store the two expert matrices as MXFP4 instead,
output-major: `gate_up_proj_blocks` (E, 2 * I, hidden / 32, 16) uint8, two 4-bit codes a
byte, and `gate_up_proj_scales` (E, 2 * I, hidden / 32) uint8 powers of two; they are decoded
at load (transformers' own decoder) into the stacked float tensors above, so the model runs
them in the run dtype (float32: 4 bytes a weight, bf16: 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.executor.layers.activation import ClampedSwigluAndMul
from pagoda.executor.layers.linear import Linear, MergedLinear
from pagoda.executor.layers.moe import Router, SparseMoeBlock
from pagoda.executor.models.gemma import SLIDING, layer_types
from pagoda.executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class GptOssAttention(LlamaAttention):
    """LlamaAttention with a bias on o_proj and a sink per head (the layer's Attention holds
    it: self_attn.attn.sinks), and the layer's window where it slides."""

    def __init__(self, config, rotary, qkv_bias: bool, sliding_window: int | None) -> None:
        super().__init__(config, rotary, qkv_bias, False, o_bias=qkv_bias, sinks=True,
                         sliding_window=sliding_window)


class GptOssExpert(nn.Module):
    """down(clamped_swiglu(gate_up(x))), both projections with a bias."""

    def __init__(self, config) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {0: size, 1: size}, bias=True)
        self.down_proj = Linear(size, config.hidden_size, bias=True)
        self.act = ClampedSwigluAndMul(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (see the module docstring)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        def make_mlp(index: int) -> nn.Module:
            experts = [GptOssExpert(config) for _ in range(config.num_local_experts)]
            return SparseMoeBlock(
                config.hidden_size, experts, config.num_experts_per_tok, normalize_top_k=False,
                softmax_after_top_k=True,
                router=Router(config.hidden_size, config.num_local_experts, bias=True))

        kinds, bias = layer_types(config), bool(config.attention_bias)

        def make_attention(index: int, rotary) -> nn.Module:
            window = config.sliding_window if kinds[index] == SLIDING else None
            return GptOssAttention(config, rotary, bias, window)

        return LlamaModel(config, bias, False, max_position, make_mlp,
                          make_attention=make_attention)

    @property
    def sliding_window(self) -> int | None:
        return None  # each sliding layer's attention carries the window

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert(weights))


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names and stacked experts as the modules take them (the module
    docstring). A GGUF file's experts come one by one already (experts.{e}.gate_proj, ...:
    STACKED_PARAMS fuses them) and pass through."""
    unpaired: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}  # MXFP4 halves
    for name, tensor in weights:
        prefix, _, last = name.rpartition(".")
        if name.endswith(".self_attn.sinks"):
            yield f"{prefix}.attn.sinks", tensor
        elif prefix.endswith(".mlp.router"):
            yield f"{prefix.removesuffix('.router')}.gate.{last}", tensor
        elif prefix.endswith(".mlp.experts") and last.endswith(("_blocks", "_scales")):
            stacked, half = last.rsplit("_", 1)
            other = unpaired.pop((prefix, stacked), None)
            if other is None:
                unpaired[(prefix, stacked)] = (half, tensor)
                continue
            blocks, scales = (tensor, other[1]) if half == "blocks" else (other[1], tensor)
            yield from _stacked(prefix, stacked, mxfp4_decoded(blocks, scales))
        elif prefix.endswith(".mlp.experts"):
            yield from _stacked(prefix, last, tensor)
        else:
            yield name, tensor
    if unpaired:
        (prefix, stacked), (half, _) = next(iter(unpaired.items()))
        missing = "scales" if half == "blocks" else "blocks"
        raise ValueError(f"checkpoint has {prefix}.{stacked}_{half} without its "
                         f"{stacked}_{missing}")


def mxfp4_decoded(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks (E, out, in / 32, 16) and scales (E, out, in / 32) -> float32
    (E, in, out), the float checkpoint's layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 expert blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not pair (blocks (..., in / 32, 16))")
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def _stacked(prefix: str, stacked: str, tensor: torch.Tensor
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor (E, ...), one slice per expert."""
    for expert, part in enumerate(tensor):
        yield from _expert_tensors(f"{prefix}.{expert}", stacked, part)


def _expert_tensors(prefix: str, stacked: str, part: torch.Tensor
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's slice of a stacked tensor -> its module tensors."""
    if stacked == "gate_up_proj":  # (hidden, 2I) interleaved -> rows [gate | up], (2I, hidden)
        rows = part.t()
        yield f"{prefix}.gate_up_proj.weight", torch.cat((rows[0::2], rows[1::2]))
    elif stacked == "gate_up_proj_bias":
        yield f"{prefix}.gate_up_proj.bias", torch.cat((part[0::2], part[1::2]))
    elif stacked == "down_proj":  # (I, hidden) -> (hidden, I)
        yield f"{prefix}.down_proj.weight", part.t().contiguous()
    elif stacked == "down_proj_bias":
        yield f"{prefix}.down_proj.bias", part
    else:
        raise ValueError(f"checkpoint tensor {prefix.rsplit('.', 1)[0]}.{stacked}: not a "
                         f"gpt-oss expert tensor")

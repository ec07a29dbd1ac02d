"""Baidu ERNIE 4.5: dense (Ernie4_5ForCausalLM) and mixture of experts (Ernie4_5_Moe).

Llama blocks whose difference is the rotary layout:

- the rotary embedding rotates adjacent pairs of each head's features (x0, x1), (x2, x3),
  ... (GPT-J's layout) where Pagoda's RotaryEmbedding rotates the two halves. Attention
  scores do not change when q and k are permuted alike, so the q and k weight rows
  are reordered at load, evens first then odds per head (`unpermute_rotary`, the same
  reordering llama.cpp's Llama converter needs undone), and the halves rotate as pairs did.
  A GGUF file's rows are reordered by the GGUF loader instead (packed rows included, which
  never reach load_weights): its config says `rotary_rows_in_halves`;
- no biases (`use_bias`, which no released model sets, is refused).

The MoE model's layers from moe_layer_start_index to moe_layer_end_index, every
moe_layer_interval, are sparse MoE blocks: softmax scores, the choice steered by
mlp.moe_statics.e_score_correction_bias (a CorrectionBiasRouter), the chosen weights
renormalised, plus shared experts (moe_num_shared_experts * moe_intermediate_size).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagoda.executor.layers.moe import CorrectionBiasRouter, SparseMoeBlock
from pagoda.executor.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, half_rotary


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """Dense ERNIE 4.5 (see the module docstring)."""

    def build_model(self, config, max_position: int) -> nn.Module:
        if getattr(config, "use_bias", False):
            raise ValueError("ERNIE 4.5 with use_bias (a bias on every projection, the MLPs' "
                             "included) is not supported; no released model sets it")
        return LlamaModel(config, False, False, max_position, self.make_mlp(config))

    def make_mlp(self, config):
        """Each layer's MLP by index; None (the dense model's): a LlamaMLP everywhere."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = self.renamed(weights)
        if not getattr(self.config, "rotary_rows_in_halves", False):
            weights = half_rotary(weights, self.config)
        super().load_weights(weights)

    def renamed(self, weights):
        """The checkpoint's names where they differ from the modules' (none)."""
        return weights


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE 4.5 MoE (see the module docstring)."""

    def make_mlp(self, config):
        def mlp(index: int) -> nn.Module:
            if not (index % config.moe_layer_interval == config.moe_layer_interval - 1
                    and config.moe_layer_start_index <= index <= config.moe_layer_end_index):
                return LlamaMLP(config)
            size = config.moe_intermediate_size
            router = CorrectionBiasRouter(config.hidden_size, config.num_experts, "softmax",
                                          normalize=True)
            shared = (LlamaMLP(config, intermediate_size=size * config.moe_num_shared_experts)
                      if config.moe_num_shared_experts else None)
            return SparseMoeBlock(
                config.hidden_size, [LlamaMLP(config, intermediate_size=size)
                                     for _ in range(config.num_experts)],
                config.num_experts_per_tok, normalize_top_k=False, weights_in_run_dtype=True,
                router=router, shared_experts=shared)

        return mlp

    def renamed(self, weights):
        """mlp.moe_statics.e_score_correction_bias (1, experts) is the router's bias."""
        for name, tensor in weights:
            if name.endswith("mlp.moe_statics.e_score_correction_bias"):
                yield name.replace("moe_statics", "gate"), tensor.reshape(-1)
            else:
                yield name, tensor

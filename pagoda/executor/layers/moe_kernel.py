"""A sparse MoE block as the C kernels take it (struct pagoda_moe, csrc/moe_f32.c): pointers
to its router, its experts' packed weights and its shared experts, made once per block and
kept with the ctypes arrays they live in.

Two callers: the eager block (layers/moe.py), which routes in PyTorch and runs the chosen
experts of a small batch in one C call (`MoEPlan.run_experts`); and the whole-stack decode
step (whole_stack_decode.py), whose MoE layers route in C too (`MoEPlan.routed`: the block's
routing rule is one of kernels.h's MOE_*).

A block is described where every expert (and the shared experts) is a SwiGLU MLP whose two
linears run Pagoda's float32 packed kernels (packed_linear.decoder_linear): a GGUF file's
types, `--quantization int4/int8`. Anything else (float weights, GELU experts, the
batch-invariant row-wise kernels) keeps the per-expert loop.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagoda.executor.kernels.abi import MAX_EXPERT_GROUPS, MOE_ROUTINGS, MoE, MoEExpert
from pagoda.executor.kernels.ops import load_cpu_kernels
from pagoda.executor.layers.activation import SiluAndMul
from pagoda.executor.layers.packed_linear import decoder_linear


def _expert(mlp: nn.Module) -> MoEExpert | None:
    """A SwiGLU MLP (LlamaMLP: gate_up_proj / down_proj; Mixtral's expert: w13 / w2)."""
    gate_up = getattr(mlp, "gate_up_proj", None) or getattr(mlp, "w13", None)
    down = getattr(mlp, "down_proj", None) or getattr(mlp, "w2", None)
    if type(getattr(mlp, "act", None)) is not SiluAndMul or mlp.act.batch_invariant:
        return None
    if getattr(gate_up, "batch_invariant", True) or getattr(down, "batch_invariant", True):
        return None
    described = [decoder_linear(gate_up), decoder_linear(down)]
    if None in described:
        return None
    return MoEExpert(gate_up=described[0], down=described[1])


def _routing(block: nn.Module) -> dict | None:
    """The MoE fields of the block's routing rule (SparseMoeBlock's softmax rules, or a
    CorrectionBiasRouter's), or None where kernels.h has no MOE_* of it or its router weight
    is not a float32 matrix. A subclass's extra steps (Granite's output multiplier) are its
    caller's to check."""
    router = block.gate
    rule = type(router).kernel_rule  # (layers/moe.py: Router)
    if (rule is None or router.weight.dtype != torch.float32
            or not router.weight.is_contiguous()
            or router.bias is not None):  # kernels.h's routers have no bias
        return None
    if rule == "biased":  # a CorrectionBiasRouter
        bias = router.e_score_correction_bias
        if router.n_group > MAX_EXPERT_GROUPS or bias.dtype != torch.float32:
            return None
        return {"routing": MOE_ROUTINGS[f"{router.scoring}_biased"],
                "normalize": int(router.normalize), "n_group": router.n_group,
                "topk_group": router.topk_group,
                "routed_scaling_factor": router.routed_scaling_factor,
                "correction_bias": bias.data_ptr()}
    rule = "top_k_softmax" if block.softmax_after_top_k else "softmax_top_k"
    return {"routing": MOE_ROUTINGS[rule], "normalize": int(block.normalize_top_k),
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}


class MoEPlan:
    """struct pagoda_moe of one block (`describe`), and the ctypes arrays it points into."""

    def __init__(self, moe: MoE, keep: list, routed: bool) -> None:
        self.moe = moe
        self._keep = keep
        self.routed = routed
        """Whether `moe` carries the block's routing rule (the decode step routes in C)."""

    @classmethod
    def describe(cls, block: nn.Module) -> MoEPlan | None:
        experts = [_expert(expert) for expert in block.experts]
        shared = None if block.shared_experts is None else _expert(block.shared_experts)
        if None in experts or (block.shared_experts is not None and shared is None):
            return None
        array = (MoEExpert * len(experts))(*experts)
        keep = [array, shared]
        routing = _routing(block)
        unrouted = {"routing": 0, "normalize": 0, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0}
        moe = MoE(num_experts=len(experts), top_k=block.top_k,
                  router=block.gate.weight.data_ptr(), experts=array,
                  shared=None if shared is None else ctypes.pointer(shared),
                  **(routing or unrouted))
        return cls(moe, keep, routed=routing is not None)

    def run_experts(self, hidden: torch.Tensor, choices: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden) float32, choices (T, top_k) the experts each token chose,
        weights (T, top_k) -> (T, hidden): the weighted sum of the chosen experts (+ the
        shared experts)."""
        x = hidden.contiguous()
        ids = choices.to(torch.int64).contiguous()
        scale = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        load_cpu_kernels().pagoda_moe_f32(ctypes.byref(self.moe), x.data_ptr(), x.shape[0],
                                          x.shape[1], ids.data_ptr(), scale.data_ptr(),
                                          out.data_ptr())
        return out

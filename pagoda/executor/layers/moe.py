"""Sparse mixture-of-experts MLP: a router picks top-k experts per token, the experts' outputs
are summed with the router's weights.

The expert matmuls are batched per expert, never per token: the (token, choice) pairs are
sorted by expert, so each expert's tokens are one contiguous slice of rows and each expert
runs once on all of its tokens. Float32 batches of packed SwiGLU experts in which no expert
gets ops.DEQUANTIZE_FROM_ROWS rows (decode steps, prefill chunks spread over many experts) do
that in one C call (layers/moe_kernel.py, csrc/moe_f32.c); other batches and experts in one
Python iteration per expert that has any:

    choices   (T * k,)   expert of each (token, choice), token-major
    order     argsort(choices): rows grouped by expert   [e0 e0 e0 | e1 | e3 e3 ...]
    rows      hidden[order // k]                          (T * k, hidden)
    out       expert e on its slice of rows, scaled by its routing weight,
              added back to its token (index_add_)

Each expert is an ordinary module (fused gate/up + down `Linear`s), so `--quantization`
quantizes experts like any other linear layer; the router stays in float (it is small, and
top-k choices are sensitive to rounding).

Under torch.compile (`--compile`) the block is one opaque custom op, `pagoda::moe`, like
attention (attention/layer.py): the per-expert loop depends on the routing (how many tokens
each expert got), which would break the graph in every MoE layer, and the compiled stack
skips its guards on modules, so a graph broken inside one layer must not be reused for
another.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.kernels.ops import DEQUANTIZE_FROM_ROWS, kernels_available
from pagoda.executor.layers.linear import default_weight_loader
from pagoda.executor.layers.moe_kernel import MoEPlan

_blocks: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_next_block_id = itertools.count()


class Router(nn.Module):
    """logits = x W^T (+ b), W (num_experts, hidden), b (num_experts,) where `bias`
    (gpt-oss). Not a `Linear`, so never quantized.

    A router with a `route(hidden, top_k)` method routes by its own rule; a plain Router's
    logits go through SparseMoeBlock's softmax rules. `kernel_rule` says which of kernels.h's
    MOE_* routings is this class's rule (layers/moe_kernel.py): "block" SparseMoeBlock's
    softmax rules, "biased" CorrectionBiasRouter's, None one the C kernel lacks (the router
    then runs here, the experts still in C)."""

    kernel_rule: str | None = "block"

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SparseMixerRouter(Router):
    """PhiMoE's top-2 routing (sparsemixer, as it runs in inference). The first expert is
    the largest logit; its weight, its softmax share among the logits within a relative
    2 * jitter_eps of it (the others masked out: (top - s) / max(|s|, top) > 2 * eps). The
    second is the largest of the other logits, weighted alike among the others near it."""

    kernel_rule = None

    def __init__(self, hidden_size: int, num_experts: int, jitter_eps: float) -> None:
        super().__init__(hidden_size, num_experts)
        self.jitter_eps = jitter_eps

    def route(self, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden) -> float32 weights (T, 2), expert ids (T, 2)."""
        if top_k != 2:
            raise ValueError(f"sparsemixer routing chooses 2 experts, not {top_k}")
        scores = F.linear(hidden.float(), self.weight.float())  # (T, E)
        weight, choice = self._choose(scores, scores)
        others = scores.scatter(-1, choice, float("-inf"))
        second_weight, second = self._choose(scores, others)
        return torch.cat((weight, second_weight), -1), torch.cat((choice, second), -1)

    def _choose(self, scores: torch.Tensor, candidates: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The best of `candidates` (T, E) and its share among the candidates near it."""
        top, choice = candidates.max(dim=-1, keepdim=True)
        far = (top - scores) / scores.abs().clamp(min=top) > 2 * self.jitter_eps
        shares = candidates.masked_fill(far, float("-inf")).softmax(dim=-1)
        return shares.gather(-1, choice), choice


def keep_best_groups(scores: torch.Tensor, n_group: int, topk_group: int,
                     group_score: Callable[[torch.Tensor], torch.Tensor],
                     fill: float) -> torch.Tensor:
    """Group-limited routing's mask: scores (T, E), its experts in `n_group` equal groups of
    consecutive ids, each group scored by `group_score` ((T, groups, E / groups) -> (T,
    groups)); the experts outside each row's `topk_group` best groups set to `fill`."""
    groups = scores.view(scores.shape[0], n_group, -1)  # (T, groups, E / groups)
    group_scores = group_score(groups)
    kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return scores.masked_fill(~mask.unsqueeze(-1).expand_as(groups).reshape_as(scores), fill)


class CorrectionBiasRouter(Router):
    """Routing whose choice adds a learned per-expert `e_score_correction_bias` to the
    scores while the weights use the scores alone: DeepSeek-V3's and GLM-4.5's noaux_tc
    (`scoring` "sigmoid", the choice limited to the `topk_group` best of `n_group` expert
    groups, a group's score its two best) and Ernie 4.5's (`scoring` "softmax", one group).
    The chosen experts' scores are renormalised where `normalize` (sum + 1e-20; Ernie's
    clamp of the sum at 1e-12 is the same wherever the sum is not ~0), then multiplied by
    `routed_scaling_factor`."""

    kernel_rule = "biased"

    def __init__(self, hidden_size: int, num_experts: int, scoring: str, normalize: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1) -> None:
        super().__init__(hidden_size, num_experts)
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"router scoring {scoring!r}: sigmoid or softmax")
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"{num_experts} experts cannot be routed in {n_group} groups, "
                             f"{topk_group} of them kept")
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts),
                                                    requires_grad=False)
        self.e_score_correction_bias.weight_loader = default_weight_loader
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.normalize, self.routed_scaling_factor = normalize, routed_scaling_factor

    def route(self, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden) -> float32 weights (T, top_k), expert ids (T, top_k)."""
        logits = F.linear(hidden.float(), self.weight.float())  # (T, E)
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:  # a group's score: its best two
            choice = keep_best_groups(choice, self.n_group, self.topk_group,
                                      lambda groups: groups.topk(2, dim=-1)[0].sum(dim=-1),
                                      float("-inf"))
        choices = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, choices)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, choices


class GroupLimitedRouter(Router):
    """DeepSeek-V2's routing: softmax over every expert; the top_k of them ("greedy",
    `n_group` 1), or of those in the `topk_group` groups (of `n_group`) whose best expert
    scores highest ("group_limited_greedy"). The weights are the chosen scores, not
    renormalised, times `routed_scaling_factor`."""

    kernel_rule = None

    def __init__(self, hidden_size: int, num_experts: int, routed_scaling_factor: float,
                 n_group: int = 1, topk_group: int = 1) -> None:
        super().__init__(hidden_size, num_experts)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"{num_experts} experts cannot be routed in {n_group} groups, "
                             f"{topk_group} of them kept")
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group

    def route(self, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden) -> float32 weights (T, top_k), expert ids (T, top_k)."""
        scores = F.linear(hidden.float(), self.weight.float()).softmax(dim=-1)  # (T, E)
        if self.topk_group < self.n_group:  # a group's score: its best
            scores = keep_best_groups(scores, self.n_group, self.topk_group,
                                      lambda groups: groups.amax(dim=-1), 0.0)
        weights, choices = torch.topk(scores, top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, choices


class SigmoidTopKRouter(Router):
    """Llama 4's routing: the top_k largest logits, each expert weighted by its logit's
    sigmoid (not normalised)."""

    kernel_rule = None

    def route(self, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden) -> float32 weights (T, top_k), expert ids (T, top_k)."""
        top, choices = torch.topk(F.linear(hidden.float(), self.weight.float()), top_k, dim=-1)
        return torch.sigmoid(top), choices


class SparseMoeBlock(nn.Module):
    """`gate` (the router) and `experts.{i}`, named as in the Hugging Face checkpoints.

    Routing: softmax over all experts in float32, the top_k largest, renormalised to sum to
    1 where `normalize_top_k` (Mixtral always; Qwen3-MoE with norm_topk_prob); or, with
    `softmax_after_top_k` (Granite MoE), the top_k largest logits, softmax over them; or a
    router's own rule (`route`: CorrectionBiasRouter's for GLM-4.5 and DeepSeek-V3,
    GroupLimitedRouter's for DeepSeek-V2, SparseMixerRouter's for PhiMoE). `router`: one of
    the block's own (those, or a Router with a bias: gpt-oss). `weights_scale_inputs`: each
    chosen expert runs on its token scaled by the weight, its output summed as it is (Llama
    4; the others scale the outputs). `shared_experts`, where given, is
    an MLP every token also runs, added to the routed experts' sum. Mixtral
    scales expert outputs by the float32 weights, Qwen3-MoE by weights cast to the run dtype
    (`weights_in_run_dtype`): Hugging Face's roundings in half precision."""

    def __init__(
        self, hidden_size: int, experts: list[nn.Module], top_k: int, normalize_top_k: bool,
        weights_in_run_dtype: bool = False, softmax_after_top_k: bool = False,
        router: Router | None = None, shared_experts: nn.Module | None = None,
        weights_scale_inputs: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= len(experts):
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{len(experts)}")
        self.gate = router or Router(hidden_size, len(experts))
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared_experts
        self.top_k, self.normalize_top_k = top_k, normalize_top_k
        self.weights_in_run_dtype = weights_in_run_dtype
        self.softmax_after_top_k = softmax_after_top_k
        self.weights_scale_inputs = weights_scale_inputs
        self.tensor_parallel_group = None
        """Set by parallel/sharding.py: each expert holds this rank's share of its rows, and
        the block's output is summed over the ranks (one all-reduce)."""
        self.block_id = next(_next_block_id)  # how the custom op finds this block
        self._plan: MoEPlan | None = None
        self._plan_key: tuple | None = None
        _blocks[self.block_id] = self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size)."""
        if torch.compiler.is_compiling():
            return torch.ops.pagoda.moe(hidden, self.block_id)
        return self.route_and_run(hidden)

    def route_and_run(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._route_and_run(hidden)
        group = self.tensor_parallel_group
        return out if group is None else group.all_reduce(out)

    def _route_and_run(self, hidden: torch.Tensor) -> torch.Tensor:
        k = self.top_k
        if hasattr(self.gate, "route"):  # a router with its own rule
            weights, choices = self.gate.route(hidden, k)
        else:
            weights, choices = self._softmax_route(hidden)
        if self.weights_in_run_dtype:
            weights = weights.to(hidden.dtype)
        plan = self._kernel_plan(hidden, choices)
        if plan is not None:
            return plan.run_experts(hidden, choices, weights)
        choices = choices.reshape(-1)
        order = torch.argsort(choices, stable=True)  # (T * k,) rows grouped by expert
        token_of_row = order // k
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()  # one sync
        rows = hidden.index_select(0, token_of_row)  # (T * k, hidden)
        row_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # (T * k, 1)
        if self.weights_scale_inputs:
            rows = (rows * row_weights).to(rows.dtype)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                end = start + count
                expert_out = expert(rows[start:end])
                if not self.weights_scale_inputs:
                    expert_out = expert_out * row_weights[start:end]
                out[start:end] = expert_out.to(out.dtype)
                start = end
        routed = torch.zeros_like(hidden).index_add_(0, token_of_row, out)
        return routed if self.shared_experts is None else routed + self.shared_experts(hidden)

    def kernel_plan(self) -> MoEPlan | None:
        """The block as the C kernels take it (layers/moe_kernel.py), made again whenever
        its experts' arithmetic settings changed; None where they cannot take it."""
        key = tuple((getattr(m, "activation_parts", None), getattr(m, "batch_invariant", None))
                    for m in self.experts[0].modules())
        if self._plan_key != key:  # (the C experts scale their outputs, never their inputs)
            self._plan = (MoEPlan.describe(self) if kernels_available(torch.float32)
                          and not self.weights_scale_inputs else None)
            self._plan_key = key
        return self._plan

    def _kernel_plan(self, hidden: torch.Tensor, choices: torch.Tensor) -> MoEPlan | None:
        """The plan where this batch runs the C experts: float32 rows on the CPU, every
        expert's fewer than ops.DEQUANTIZE_FROM_ROWS (the packed kernel's rows, as each
        expert's own linears would take them; an expert with more dequantizes its weight for
        BLAS in the per-expert loop)."""
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        if hidden.shape[0] >= DEQUANTIZE_FROM_ROWS and int(torch.bincount(
                choices.reshape(-1), minlength=len(self.experts)).max()) >= DEQUANTIZE_FROM_ROWS:
            return None  # (a token chooses an expert once: fewer tokens, fewer rows)
        return self.kernel_plan()

    def _softmax_route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights (T, k) and expert ids (T, k) by the softmax rules above."""
        k = self.top_k
        logits = self.gate(hidden).float()  # (T, E)
        if self.softmax_after_top_k:
            top_logits, choices = torch.topk(logits, k, dim=-1)  # (T, k)
            weights = torch.softmax(top_logits, dim=-1)
        else:
            weights, choices = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, choices


def routed_expert_modules(model: nn.Module):
    """(block, expert index, module) for every module inside the routed experts of each
    sparse MoE block of `model` (not its shared experts): a token reads block.top_k of them."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            for index, expert in enumerate(block.experts):
                for module in expert.modules():
                    yield block, index, module


def _moe_op(hidden: torch.Tensor, block_id: int) -> torch.Tensor:
    return _blocks[block_id].route_and_run(hidden)


_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("moe(Tensor hidden, int block_id) -> Tensor")
_library.impl("moe", _moe_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::moe")
def _(hidden: torch.Tensor, block_id: int) -> torch.Tensor:
    return torch.empty_like(hidden)

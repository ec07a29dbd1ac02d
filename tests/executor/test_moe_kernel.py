"""Sparse MoE blocks in C (csrc/moe_f32.c through layers/moe_kernel.py): the chosen experts of
a small batch in one call, and the routing rules of the decode step, each held to the
PyTorch block it replaces (the per-expert loop, the block's own routing) on the packed
experts of a tiny Qwen3-MoE GGUF file (Q4_K gate / up, Q6_K down)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagoda.executor.kernels.ops import DEQUANTIZE_FROM_ROWS, load_cpu_kernels
from pagoda.executor.layers.moe import CorrectionBiasRouter, SparseMoeBlock
from pagoda.executor.layers.moe_kernel import MoEPlan
from tests.executor.test_cpu_kernels import isa_build  # noqa: F401 (a fixture)
from tests.executor.test_decode_kernel import moe_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded_block(tmp_path_factory) -> SparseMoeBlock:
    """Layer 0's block of a tiny Qwen3-MoE file: 4 packed experts, 2 chosen a token."""
    llm = moe_engine(tmp_path_factory.mktemp("qwen3-moe"), "qwen3-moe")
    block = llm.engine.runner.model.model.layers[0].mlp
    block.llm = llm  # keeps the engine (and its weights) alive with the block
    return block


def variant(loaded: SparseMoeBlock, seed: int, router: str = "softmax",
            **options) -> SparseMoeBlock:
    """A block over `loaded`'s experts with a random router: `router` "softmax" (the
    block's softmax rules: `options` normalize_top_k, softmax_after_top_k,
    shared_experts) or a CorrectionBiasRouter's scoring ("sigmoid" / "softmax_biased",
    `options` its normalize, routed_scaling_factor, n_group, topk_group) with a random bias."""
    generator = torch.Generator().manual_seed(seed)
    hidden, experts = loaded.gate.weight.shape[1], list(loaded.experts)
    gate = None
    if router != "softmax":
        gate = CorrectionBiasRouter(hidden, len(experts), router.removesuffix("_biased"),
                                    **{k: options.pop(k) for k in list(options)
                                       if k not in ("shared_experts",)})
        gate.e_score_correction_bias.data = torch.randn(len(experts), generator=generator)
    block = SparseMoeBlock(hidden, experts, loaded.top_k,
                           normalize_top_k=options.pop("normalize_top_k", False), router=gate,
                           **options)
    block.gate.weight.data = torch.randn(len(experts), hidden, generator=generator) * 0.2
    return block


def hidden_rows(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))


def routed_in_c(block: SparseMoeBlock, hidden: torch.Tensor):
    """(choices, weights) of pagoda_moe_route_f32, each (T, top_k)."""
    plan = block.kernel_plan()
    assert plan is not None and plan.routed
    choices = torch.empty(hidden.shape[0], block.top_k, dtype=torch.int64)
    weights = torch.empty(hidden.shape[0], block.top_k)
    load_cpu_kernels().pagoda_moe_route_f32(ctypes.byref(plan.moe), hidden.data_ptr(),
                                            hidden.shape[0], hidden.shape[1],
                                            choices.data_ptr(), weights.data_ptr())
    return choices, weights


def routed_in_pytorch(block: SparseMoeBlock, hidden: torch.Tensor):
    if isinstance(block.gate, CorrectionBiasRouter):
        return block.gate.route(hidden, block.top_k)
    return block._softmax_route(hidden)


ROUTINGS = {  # id: (router, options)
    "softmax, top-k": ("softmax", {}),
    "softmax, top-k, renormalised": ("softmax", {"normalize_top_k": True}),
    "top-k logits, softmax (Granite)": ("softmax", {"softmax_after_top_k": True}),
    "sigmoid, biased, 2 groups of which 1 kept, scaled (DeepSeek-V3, GLM-4.5)": (
        "sigmoid", {"normalize": True, "routed_scaling_factor": 2.5, "n_group": 2,
                    "topk_group": 1}),
    "sigmoid, biased, one group, not renormalised": ("sigmoid", {"normalize": False}),
    "softmax, biased, renormalised (Ernie 4.5)": ("softmax_biased", {"normalize": True}),
}


def assert_routes_alike(block: SparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
    """C's routing chooses the block's experts, with its weights; returns C's choices."""
    choices, weights = routed_in_c(block, hidden)
    expected_weights, expected_choices = routed_in_pytorch(block, hidden)
    ours, theirs = choices.sort(dim=1), expected_choices.sort(dim=1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(weights.gather(1, ours.indices),
                               expected_weights.float().gather(1, theirs.indices),
                               rtol=1e-5, atol=1e-6)
    return choices


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_c_routing_chooses_and_weighs_as_the_block_does(loaded_block, routing) -> None:
    router, options = ROUTINGS[routing]
    block = variant(loaded_block, seed=len(routing), router=router, **options)
    hidden = hidden_rows(64, seed=1)
    choices = assert_routes_alike(block, hidden)
    if options.get("n_group"):  # every token's experts lie in one group (of 2 experts)
        assert torch.equal(choices.min(dim=1).values // 2, choices.max(dim=1).values // 2)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("shared", [False, True])
def test_the_c_experts_give_the_per_expert_loops_sum(loaded_block, rows, shared,
                                                     monkeypatch) -> None:
    """A batch's chosen experts in one C call against one PyTorch matmul pair per expert
    (the same packed kernels; only SiLU rounds differently): with a shared expert, too."""
    block = variant(loaded_block, seed=rows, normalize_top_k=True,
                    shared_experts=loaded_block.experts[3] if shared else None)
    hidden = hidden_rows(rows, seed=rows + 10)
    calls = []
    run_experts = MoEPlan.run_experts
    monkeypatch.setattr(MoEPlan, "run_experts",
                        lambda plan, *args: calls.append(1) or run_experts(plan, *args))
    ours = block(hidden)
    assert calls == [1]
    monkeypatch.setattr(block, "_kernel_plan", lambda hidden, choices: None)
    theirs = block(hidden)
    assert calls == [1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("rows", [DEQUANTIZE_FROM_ROWS + 2, 2 * DEQUANTIZE_FROM_ROWS])
def test_an_expert_with_a_large_batch_of_rows_takes_the_per_expert_loop(loaded_block, rows,
                                                                         monkeypatch) -> None:
    """From ops.DEQUANTIZE_FROM_ROWS rows on, an expert's matmul dequantizes for BLAS, as
    every linear's does: a batch in which any expert gets that many loops over its experts
    (4 experts, 2 a token: 256 tokens give one of them 128 rows at least); a longer batch
    spread thinner stays in C."""
    block = variant(loaded_block, seed=5)
    hidden = hidden_rows(rows, seed=6)
    most = int(torch.bincount(routed_in_pytorch(block, hidden)[1].reshape(-1)).max())
    calls = []
    run_experts = MoEPlan.run_experts
    monkeypatch.setattr(MoEPlan, "run_experts",
                        lambda plan, *args: calls.append(1) or run_experts(plan, *args))
    ours = block(hidden)
    assert calls == ([] if most >= DEQUANTIZE_FROM_ROWS else [1])
    assert (rows, most >= DEQUANTIZE_FROM_ROWS) in ((DEQUANTIZE_FROM_ROWS + 2, False),
                                                    (2 * DEQUANTIZE_FROM_ROWS, True))
    monkeypatch.setattr(block, "_kernel_plan", lambda hidden, choices: None)
    torch.testing.assert_close(ours, block(hidden), rtol=1e-5, atol=1e-4)


def test_float_experts_keep_the_per_expert_loop(loaded_block) -> None:
    """Experts whose weights are not packed (a checkpoint loaded as float) have no plan."""
    from pagoda.executor.models.llama import LlamaMLP

    config = type("Config", (), {"hidden_size": 256, "intermediate_size": 64,
                                 "hidden_act": "silu"})()
    experts = [LlamaMLP(config) for _ in range(4)]
    block = SparseMoeBlock(256, experts, 2, normalize_top_k=True)
    assert block.kernel_plan() is None


@pytest.mark.parametrize("rows", [1, 5])
def test_every_instruction_set_build_runs_the_layer_as_its_per_expert_loop(
        loaded_block, isa_build, rows, monkeypatch) -> None:  # noqa: F811
    """The C layer (routing, then the chosen experts) on each float32 build this CPU runs,
    ARM64's emulation build included (test_cpu_kernels.runnable_builds), against the
    per-expert loop over the same build's packed kernels: every CPU kind's MoE path."""
    from pagoda.executor.kernels import ops
    from pagoda.executor.layers import moe_kernel

    monkeypatch.setattr(moe_kernel, "load_cpu_kernels", ops.load_cpu_kernels)
    block = variant(loaded_block, seed=rows + 20, normalize_top_k=True,
                    shared_experts=loaded_block.experts[3])
    hidden = hidden_rows(rows, seed=rows + 30)
    assert_routes_alike(block, hidden)
    ours = block(hidden)
    monkeypatch.setattr(block, "_kernel_plan", lambda hidden, choices: None)
    theirs = block(hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())

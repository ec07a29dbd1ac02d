"""ModelLoRA over a real (tiny, random) Pagoda model with hand-made adapter pairs: the
hooked forward equals the base weights with B @ A merged in, per row (rows of other
adapters and of the base untouched in the same forward); FusedLoRA's tensor-parallel cuts
sum (row-parallel) or stack (column-parallel) back to the whole delta."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagoda.executor.lora.fused import MODULE_TARGETS, ModuleShape, fuse
from pagoda.executor.lora.model_lora import ModelLoRA
from pagoda.executor.lora.step import LoRAStep, current_lora_step, lora_step
from tests.executor.test_model_parity import pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint

PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [120, 4] * 6, [1, 2, 3]]
SIZES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
         "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
"""(out, in) of each target in tests/executor/tiny_checkpoints.py's llama."""
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
             "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def random_pairs(seed: int, targets=tuple(SIZES), rank: int = 4, layers: int = 2) -> dict:
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer in range(layers):
        for target in targets:
            out, inp = SIZES[target]
            pairs[layer, target] = SimpleNamespace(
                a=torch.randn(rank, inp, generator=generator) * 0.3,
                b=torch.randn(out, rank, generator=generator) * 0.3)
    return pairs


def merged_logits(reference, pairs: dict, prompt: list[int]) -> torch.Tensor:
    """transformers' logits with every pair merged into its weight (a copy of the model)."""
    import copy

    model = copy.deepcopy(reference)
    with torch.no_grad():
        for (layer, target), pair in pairs.items():
            owner = getattr(model.model.layers[layer], HF_MODULE[target])
            getattr(owner, target).weight += pair.b @ pair.a
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    reference = build_checkpoint("llama", folder)
    runner = pagoda_runner(folder)
    lora = ModelLoRA(runner.model, max_loras=2)
    yield reference, runner, lora
    lora.detach()


def test_no_step_is_the_base_model(tiny) -> None:
    reference, runner, lora = tiny
    lora.add_adapter(1, random_pairs(1))
    assert current_lora_step() is None
    ours = runner.prompt_logits([PROMPTS[0]])[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    lora.remove_adapter(1)


def test_rows_of_each_adapter_equal_their_merged_model(tiny) -> None:
    reference, runner, lora = tiny
    adapters = {1: random_pairs(1), 2: random_pairs(2, targets=("q_proj", "v_proj"))}
    for lora_int_id, pairs in adapters.items():
        lora.add_adapter(lora_int_id, pairs)
    lora.set_slot(0, 1)
    lora.set_slot(1, 2)
    # prompt 0 -> adapter 1, prompt 1 -> base, prompt 2 -> adapter 2
    slots_of_prompt = [0, -1, 1]
    row_slots = np.concatenate([np.full(len(p), s, np.int32)
                                for p, s in zip(PROMPTS, slots_of_prompt)])
    step = LoRAStep.from_rows(row_slots, lora.slots)
    with lora_step(step):
        logits = runner.prompt_logits(PROMPTS)
    expected = [merged_logits(reference, adapters[1], PROMPTS[0]),
                merged_logits(reference, {}, PROMPTS[1]),
                merged_logits(reference, adapters[2], PROMPTS[2])]
    for ours, theirs in zip(logits, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # and the adapter changes the output (the test would see a hook that does nothing)
    assert (logits[0] - merged_logits(reference, {}, PROMPTS[0])).abs().max() > 1e-2
    version = lora.version
    lora.remove_adapter(1)
    lora.remove_adapter(2)
    assert lora.slots == [None, None] and lora.version > version and not lora.loaded


def test_scattered_rows_take_the_index_path(tiny) -> None:
    """Rows of one adapter that are not contiguous (base rows between them)."""
    reference, runner, lora = tiny
    pairs = random_pairs(3)
    lora.add_adapter(7, pairs)
    lora.set_slot(0, 7)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    row_slots = np.concatenate([np.full(len(p), s, np.int32)
                                for p, s in zip(prompts, [0, -1, 0])])
    step = LoRAStep.from_rows(row_slots, lora.slots)
    assert isinstance(step.groups[0][1], torch.Tensor)
    with lora_step(step):
        logits = runner.prompt_logits(prompts)
    for prompt, ours, adapter in zip(prompts, logits, [pairs, {}, pairs]):
        torch.testing.assert_close(ours, merged_logits(reference, adapter, prompt),
                                   atol=1e-4, rtol=1e-4)
    lora.remove_adapter(7)


def test_step_groups() -> None:
    assert LoRAStep.from_rows(np.full(5, -1, np.int32), [None]) is None
    step = LoRAStep.from_rows(np.array([-1, 1, 1, 0, -1, 0], np.int32), [11, 12])
    assert step.groups[0][0] == 11 and step.groups[0][1].tolist() == [3, 5]
    assert step.groups[1] == (12, slice(1, 3))
    assert step.row_slots.dtype == np.int32


def test_bad_pairs_are_refused(tiny) -> None:
    _, _, lora = tiny
    with pytest.raises(ValueError, match="layer 5 q_proj"):
        lora.add_adapter(3, {(5, "q_proj"): random_pairs(0)[0, "q_proj"]})
    wrong = random_pairs(0, targets=("o_proj",))
    wrong[0, "o_proj"].a = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        lora.add_adapter(3, wrong)
    assert not lora.loaded


def test_tensor_parallel_cuts_sum_to_the_whole() -> None:
    """Column-parallel (qkv): ranks' rows stack to the whole delta; row-parallel (down): the
    ranks' column shares sum to it."""
    pairs = random_pairs(5, layers=1)
    x = torch.randn(3, 64)
    qkv = ModuleShape(MODULE_TARGETS["qkv_proj"], (64, 32, 32), 64, ((0, 64), (0, 32), (0, 32)))
    whole = fuse(qkv, pairs, 0).delta(x, 128)
    shards = [ModuleShape(qkv.targets, qkv.out_sizes, 64, ((0, 32), (0, 16), (0, 16))),
              ModuleShape(qkv.targets, qkv.out_sizes, 64, ((32, 64), (16, 32), (16, 32)))]
    deltas = [fuse(s, pairs, 0).delta(x, 64) for s in shards]
    q = torch.cat([d[:, :32] for d in deltas], 1)
    k = torch.cat([d[:, 32:48] for d in deltas], 1)
    v = torch.cat([d[:, 48:] for d in deltas], 1)
    torch.testing.assert_close(torch.cat([q, k, v], 1), whole)
    down = ModuleShape(("down_proj",), (64,), 96, ((0, 64),))
    h = torch.randn(3, 96)
    whole = fuse(down, pairs, 0).delta(h, 64)
    halves = [fuse(ModuleShape(down.targets, (64,), 96, ((0, 64),), cols), pairs, 0)
              .delta(h[:, cols[0]:cols[1]], 64) for cols in ((0, 48), (48, 96))]
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-5, rtol=1e-5)


def test_a_model_without_the_four_projections_is_refused(tmp_path) -> None:
    build_checkpoint("mixtral", str(tmp_path))
    with pytest.raises(ValueError, match="SparseMoeBlock MLP does not have them all"):
        ModelLoRA(pagoda_runner(str(tmp_path)).model, max_loras=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_loaded_adapter_holds_its_own_size(tiny, dtype) -> None:
    """Each adapter's fused tensors are its pairs' numbers in their own dtype, once (no
    merged copy; B held transposed, (rank, out_size), and nowhere else)."""
    _, _, lora = tiny
    pairs = {key: SimpleNamespace(a=p.a.to(dtype), b=p.b.to(dtype)) for key, p in random_pairs(
        4, targets=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj")).items()}
    lora.add_adapter(4, pairs)
    assert lora.loaded[4] == dtype.itemsize * sum(p.a.numel() + p.b.numel()
                                                  for p in pairs.values())
    assert lora.fused(0, 2, 4).parts[0].out_offset == 96  # up's rows follow gate's
    qkv = lora.fused(1, 0, 4)
    assert len(qkv.parts) == 2 and qkv.rank == 8 and qkv.dtype == dtype
    k_part = qkv.parts[1]
    assert k_part.b_t.shape == (4, 32) and k_part.b_t.is_contiguous()
    assert torch.equal(k_part.b_t, pairs[1, "k_proj"].b.T)
    lora.remove_adapter(4)


def test_half_width_adapters_compute_in_float32(tiny) -> None:
    """A bfloat16 adapter's rows in the float32 model are the float32 sums of its numbers
    widened (the merged model of the widened pairs), and its tensors stay bfloat16."""
    reference, runner, lora = tiny
    pairs = {key: SimpleNamespace(a=p.a.bfloat16(), b=p.b.bfloat16())
             for key, p in random_pairs(5).items()}
    lora.add_adapter(5, pairs)
    lora.set_slot(0, 5)
    step = LoRAStep.from_rows(np.zeros(len(PROMPTS[0]), np.int32), lora.slots)
    with lora_step(step):
        ours = runner.prompt_logits([PROMPTS[0]])[0]
    widened = {key: SimpleNamespace(a=p.a.float(), b=p.b.float()) for key, p in pairs.items()}
    assert ours.dtype == torch.float32 and lora.fused(0, 0, 5).a.dtype == torch.bfloat16
    torch.testing.assert_close(ours, merged_logits(reference, widened, PROMPTS[0]),
                               atol=1e-4, rtol=1e-4)
    lora.remove_adapter(5)

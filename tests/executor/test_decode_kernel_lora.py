"""LoRA adapters in the whole-stack decode step (csrc/lora_f32.c through
whole_stack_decode.py's slot tables): decode steps whose rows run adapters stay one C call,
and give the eager forward's tokens and logprobs (its hooks add the same adapters) within
float32 rounding: rows of several adapters, rows of the base model and adapters of a few
targets side by side in one batch, over packed weights of several formats, adapters stored
in float32, bfloat16 and float16; a change of the slotted adapters is seen at the next
step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda import SamplingParams
from pagoda.executor.models.llama import head_dim_of
from pagoda.lora.request import LoRARequest
from tests.executor.test_decode_kernel import (
    PROMPTS,
    assert_same_completions,
    engine_of,
    legacy_quants,
    mixed_type,
    tiny_gguf,
    whole_stack_steps,
)

pytestmark = pytest.mark.slow  # (make test-fast skips it)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_pairs(config, seed: int, rank: int, targets=ALL, scale: float = 0.05,
                 dtype: torch.dtype = torch.float32) -> dict:
    """{(layer, target): pair (a (rank, in), b (out, rank) pre-scaled)} in `dtype`, as the
    files helper's load_lora_weights gives them, random."""
    head_dim = head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    sizes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
             "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
             "down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    return {(layer, target): SimpleNamespace(
                a=(torch.randn(rank, sizes[target][1], generator=generator) * scale).to(dtype),
                b=(torch.randn(sizes[target][0], rank, generator=generator) * scale).to(dtype))
            for layer in range(config.num_hidden_layers) for target in targets}


@pytest.fixture(autouse=True)
def hand_made_adapters_pass_the_front_checks(monkeypatch) -> None:
    """LLM.generate reads an adapter's files before the engine sees it (adapter_checks.py);
    these adapters have none (the runner's manager is handed their pairs)."""
    monkeypatch.setattr("pagoda.entrypoints.llm.check_lora_request", lambda *args: None)


def with_adapters(llm, adapters: dict[int, dict]) -> dict[int, LoRARequest]:
    """Serve hand-made adapters: the runner's manager loads them by lora_int_id."""
    manager = llm.engine.runner.lora
    manager._load = lambda request, hf_config, max_rank: adapters[request.lora_int_id]
    return {i: LoRARequest(f"adapter-{i}", i, f"/nonexistent/adapter-{i}") for i in adapters}


def generate(llm, prompts, loras, enabled: bool, max_tokens: int = 10):
    llm.engine.runner.whole_stack.enabled = enabled
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    before = whole_stack_steps(llm)
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    llm.engine.runner.whole_stack.enabled = True
    return [out.outputs[0] for out in outputs], whole_stack_steps(llm) - before


def assert_close_completions(fused, eager, tolerance: float) -> None:
    for ours, theirs in zip(fused, eager, strict=True):
        assert list(ours.token_ids) == list(theirs.token_ids)
        for position_ours, position_theirs in zip(ours.logprobs, theirs.logprobs, strict=True):
            for token in position_ours.keys() & position_theirs.keys():
                assert abs(position_ours[token].logprob
                           - position_theirs[token].logprob) < tolerance


@pytest.mark.parametrize("arch, types, options", [
    ("llama", mixed_type, {}),  # fused qkv and gate-up of several formats (segments)
    ("qwen3", legacy_quants, {}),  # q/k norms, head_dim apart from hidden / heads
    ("llama", mixed_type, {"decode_activations": "int8"}),  # 8-bit activations
])
def test_decode_steps_with_adapters_run_in_c_as_the_eager_forward(arch, types, options,
                                                                  tmp_path) -> None:
    """With 8-bit activations the next linear quantizes each adapter-added output, so the
    adapters' float32 rounding (C and torch sum in different orders) can move an 8-bit code
    by one: the same tokens, logprobs within 1e-2 there; 1e-4 with float32 activations."""
    llm = engine_of(tiny_gguf(tmp_path, arch, types), enable_lora=True, max_loras=3,
                    **options)
    config = llm.engine.runner.lora.hf_config
    requests = with_adapters(llm, {
        1: random_pairs(config, 1, rank=8),
        2: random_pairs(config, 2, rank=4, targets=("q_proj", "v_proj")),
        3: random_pairs(config, 3, rank=16, targets=("o_proj", "down_proj", "up_proj")),
    })
    prompts = [*PROMPTS, PROMPTS[0]]
    loras = [requests[1], None, requests[2], requests[3]]  # the last prompt: the first's
    fused, calls = generate(llm, prompts, loras, enabled=True)
    eager, eager_calls = generate(llm, prompts, loras, enabled=False)
    assert calls >= 8 and eager_calls == 0  # decode steps with adapter rows ran in C
    if options:
        assert_close_completions(fused, eager, 1e-2)
    else:
        assert_same_completions(fused, eager)
    base, _ = generate(llm, prompts, None, enabled=True)
    assert_same_completions(fused[1:2], base[1:2])  # the base row: the base model's
    # the adapters really act: the first prompt under adapter 1 and 3 differ from the base's
    for ours in (fused[0], fused[3]):
        assert any(abs(a[t].logprob - b[t].logprob) > 1e-3 for a, b in
                   zip(ours.logprobs, base[0].logprobs) for t in a.keys() & b.keys())


def test_bfloat16_and_float16_adapters_run_in_c_as_the_eager_forward(tmp_path) -> None:
    """Adapters stored in bfloat16 and float16 (--lora-dtype, or a bf16 file under auto) next
    to a float32 one in one batch: C widens their numbers as it loads them, the eager hooks
    widen them per call, so both sum the same float32 products: the same tokens and
    logprobs (1e-4). The C tables point at the adapters' own half-width tensors."""
    llm = engine_of(tiny_gguf(tmp_path, "llama", mixed_type), enable_lora=True, max_loras=3)
    config = llm.engine.runner.lora.hf_config
    requests = with_adapters(llm, {
        1: random_pairs(config, 1, rank=8, dtype=torch.bfloat16),
        2: random_pairs(config, 2, rank=4, targets=("q_proj", "v_proj"), dtype=torch.float16),
        3: random_pairs(config, 3, rank=16, targets=("o_proj", "down_proj", "up_proj")),
    })
    prompts = [*PROMPTS, PROMPTS[0]]
    loras = [requests[1], None, requests[2], requests[3]]
    fused, calls = generate(llm, prompts, loras, enabled=True)
    model_lora = llm.engine.runner.lora.model_lora
    assert model_lora.fused(0, 0, 1).a.dtype == torch.bfloat16
    assert model_lora.fused(0, 0, 2).parts[0].b_t.dtype == torch.float16
    assert model_lora.fused(0, 1, 3).a.dtype == torch.float32
    table = llm.engine.runner.whole_stack._lora._tables[0][0]  # layer 0's qkv: slots 0..2
    pointers = {table[s].a for s in range(3)}
    assert model_lora.fused(0, 0, 1).a.data_ptr() in pointers  # no copy: its own tensor
    eager, eager_calls = generate(llm, prompts, loras, enabled=False)
    assert calls >= 8 and eager_calls == 0
    assert_same_completions(fused, eager)
    base, _ = generate(llm, prompts, None, enabled=True)
    for ours in (fused[0], fused[2]):  # the bf16 and f16 adapters act
        assert any(abs(a[t].logprob - b[t].logprob) > 1e-3 for a, b in
                   zip(ours.logprobs, base[0 if ours is fused[0] else 2].logprobs)
                   for t in a.keys() & b.keys())


def test_new_slot_contents_reach_the_next_c_step(tmp_path) -> None:
    """One slot, adapters taking turns in it (ModelLoRA.version changes): each run's C steps
    use the adapter in the slot then, as the eager forward does."""
    llm = engine_of(tiny_gguf(tmp_path, "llama", mixed_type), enable_lora=True, max_loras=1)
    config = llm.engine.runner.lora.hf_config
    requests = with_adapters(llm, {i: random_pairs(config, i, rank=8) for i in (1, 2)})
    runs = []
    for lora_int_id in (1, 2, 1):
        loras = [requests[lora_int_id]] * len(PROMPTS)
        fused, calls = generate(llm, PROMPTS, loras, enabled=True, max_tokens=6)
        eager, _ = generate(llm, PROMPTS, loras, enabled=False, max_tokens=6)
        assert calls >= 4
        assert_same_completions(fused, eager)
        runs.append(fused)
    assert_same_completions(runs[2], runs[0])
    assert any(list(a.token_ids) != list(b.token_ids) or any(
        abs(x[t].logprob - y[t].logprob) > 1e-3 for x, y in zip(a.logprobs, b.logprobs)
        for t in x.keys() & y.keys()) for a, b in zip(runs[0], runs[1]))

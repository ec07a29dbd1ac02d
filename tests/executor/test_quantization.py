"""Dynamic int8 linears: the kernel against F.linear, the model conversion, errors, end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import CacheConfig, ModelConfig
from pagoda.executor.layers import quantization
from pagoda.executor.layers.linear import Linear, MergedLinear
from pagoda.executor.layers.quantization import (
    Int8DynamicLinear,
    Int8LogitsHead,
    check_int8_supported,
)
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.model_runner import ModelRunner
from tests.entrypoints.test_cli import run_cli
from tests.executor.test_model_parity import PROMPTS, pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint

MAX_RELATIVE_ERROR = 0.03
"""Per-channel int8 weights and per-call int8 activations on Gaussian data: ~1-2%."""


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference).norm() / reference.norm()).item()


def random_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    linear = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 1.0)
    return linear


def test_int8_linear_matches_float_linear() -> None:
    torch.manual_seed(0)
    linear = random_linear(256, 384, bias=True)
    x = torch.randn(16, 256)
    reference = F.linear(x, linear.weight, linear.bias)  # (16, 384)
    int8 = Int8DynamicLinear.from_linear(linear)
    y = int8(x)
    assert y.shape == (16, 384) and y.dtype == torch.float32
    assert relative_error(y, reference) < MAX_RELATIVE_ERROR
    # Activations in bf16 come back in bf16 (the run dtype), or in the dtype asked for.
    assert int8(x.bfloat16()).dtype == torch.bfloat16
    assert relative_error(int8(x.bfloat16()), reference) < MAX_RELATIVE_ERROR
    assert int8(x.bfloat16(), out_dtype=torch.float32).dtype == torch.float32
    assert int8(x.view(4, 4, 256)).shape == (4, 4, 384)
    # No float copy of the weight is kept.
    assert not list(int8.parameters())


def test_merged_linear_with_bias_keeps_each_part() -> None:
    """Qwen2's fused qkv with a bias: every part's rows and bias survive quantization."""
    torch.manual_seed(0)
    merged = MergedLinear(64, {"q": 64, "k": 32, "v": 32}, bias=True)
    parts = {"q": 64, "k": 32, "v": 32}
    for shard_id, size in parts.items():
        merged.weight.weight_loader(merged.weight, torch.randn(size, 64) * 0.1, shard_id)
        merged.bias.weight_loader(merged.bias, torch.randn(size) + 3.0, shard_id)
    x = torch.randn(8, 64)
    reference = F.linear(x, merged.weight, merged.bias)
    y = Int8DynamicLinear.from_linear(merged)(x)
    assert relative_error(y, reference) < MAX_RELATIVE_ERROR
    # The bias is really applied: without it the output is far off.
    assert relative_error(y - merged.bias, reference) > 0.5


def test_outlier_rows_are_quantized_apart(monkeypatch) -> None:
    """One row 1000x the others (like a sequence's first token) must not wipe out the rest."""
    torch.manual_seed(0)
    linear = random_linear(256, 128, bias=False)
    x = torch.randn(8, 256)
    x[3] *= 1000
    reference = F.linear(x, linear.weight)
    int8 = Int8DynamicLinear.from_linear(linear)
    normal = [0, 1, 2, 4, 5, 6, 7]
    assert relative_error(int8(x)[normal], reference[normal]) < MAX_RELATIVE_ERROR
    assert relative_error(int8(x)[3], reference[3]) < MAX_RELATIVE_ERROR
    monkeypatch.setattr(quantization, "OUTLIER_ROW_FACTOR", float("inf"))
    assert relative_error(int8(x)[normal], reference[normal]) > 0.3  # what the split prevents


def test_logits_head_picks_int8_or_float_by_rows() -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(1000, 64).bfloat16(), requires_grad=False)
    head = Int8LogitsHead(weight, max_int8_rows=4)
    small, large = torch.randn(3, 64).bfloat16(), torch.randn(9, 64).bfloat16()
    for hidden in (small, large):
        logits = head(hidden)
        assert logits.shape == (hidden.shape[0], 1000) and logits.dtype == torch.float32
        assert relative_error(logits, F.linear(hidden.float(), weight.float())) < MAX_RELATIVE_ERROR
    torch.testing.assert_close(head(small), head.int8(small, out_dtype=torch.float32))
    torch.testing.assert_close(head(large), F.linear(large, weight).float())
    # A float32 matmul is slower than int8 at any number of rows: always int8.
    assert Int8LogitsHead(weight.float(), max_int8_rows=4).max_int8_rows is None


def quantized_tiny_model(arch: str, folder: str) -> nn.Module:
    build_checkpoint(arch, folder)
    checkpoint = open_checkpoint(resolve_model_files(folder))
    return load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=256,
                      quantization="int8")


def test_tied_model_has_no_float_linear_left(tmp_path) -> None:
    """Qwen2 (qkv bias, tied embeddings): every Linear is int8, the embedding stays float and
    is the head's float weight, and logits follow the float32 model."""
    model = quantized_tiny_model("qwen2", str(tmp_path))
    assert not [name for name, m in model.named_modules() if isinstance(m, Linear)]
    int8_names = [name for name, m in model.named_modules() if isinstance(m, Int8DynamicLinear)]
    assert len(int8_names) == 2 * 4 + 1  # 4 per layer (qkv, o, gate_up, down) + the head
    assert isinstance(model.lm_head, Int8LogitsHead)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, nn.Embedding) and embedding.weight.dtype == torch.float32
    assert model.lm_head.float_weight is embedding.weight

    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache(64)
    float_logits = pagoda_runner(str(tmp_path)).prompt_logits(PROMPTS)
    for ours, reference in zip(runner.prompt_logits(PROMPTS), float_logits):
        assert ours.dtype == torch.float32 and ours.shape == reference.shape
        # Measured: 2% relative error, 92-100% top-1 agreement per prompt.
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.85
        assert relative_error(ours, reference) < 0.05


def test_untied_head_is_quantized_too(tmp_path) -> None:
    model = quantized_tiny_model("llama", str(tmp_path))
    assert not [name for name, m in model.named_modules() if isinstance(m, Linear)]
    assert isinstance(model.lm_head, Int8LogitsHead)
    assert model.lm_head.float_weight is not model.model.embed_tokens.weight


def test_config_rejects_unknown_quantization() -> None:
    assert ModelConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be None or one of int8, got 'int4'"):
        ModelConfig(quantization="int4")


def test_int8_refuses_other_devices_and_builds(monkeypatch) -> None:
    check_int8_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only.*cuda"):
        check_int8_supported(torch.device("cuda"))
    monkeypatch.setattr(quantization, "supported_quantized_engines", lambda: ["qnnpack"])
    with pytest.raises(ValueError, match="fbgemm, x86 or onednn.*has qnnpack"):
        check_int8_supported(torch.device("cpu"))


def test_cli_rejects_unknown_quantization() -> None:
    result = run_cli("generate", "--quantization", "int4", "hi")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--quantization: invalid choice: 'int4'" in result.stderr and "int8" in result.stderr


def test_cli_int8_on_a_non_cpu_device_is_a_one_line_error() -> None:
    result = run_cli("generate", "--quantization", "int8", "--device", "meta", "hi")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pagoda: error:")]
    assert len(errors) == 1 and "CPU only" in errors[0], result.stderr


@pytest.mark.slow
def test_int8_engine_answers_a_chat_prompt() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(quantization="int8", kv_cache_memory=64 * 1024 * 1024, max_model_len=512)
    assert isinstance(llm.engine.runner.model.lm_head, Int8LogitsHead)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text

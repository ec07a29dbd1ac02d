"""Weight-only int8/int4 linears: the codes, each kernel (Pagoda's, PyTorch's int4, dense)
against F.linear, the float path for large batches, the model conversion (int8 head
included), errors, end to end. The C kernel itself is tested in test_cpu_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import CacheConfig, ModelConfig
from pagoda.executor.kernels.ops import kernels_available
from pagoda.executor.layers import quantization
from pagoda.executor.layers.linear import Linear, MergedLinear
from pagoda.executor.layers.quantization import (
    QuantizedLinear,
    check_quantization_supported,
    choose_kernel,
)
from pagoda.executor.loader import model_loader
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import (
    GGUF_OWN_TYPES,
    load_model,
    open_checkpoint,
    resolve_quantization,
)
from pagoda.executor.model_runner import ModelRunner
from tests.entrypoints.test_cli import run_cli
from tests.executor.test_cpu_kernels import gguf_like_weight, needs_bf16_kernels
from tests.executor.test_model_parity import PROMPTS, pagoda_runner
from tests.executor.tiny_checkpoints import build_checkpoint

MAX_RELATIVE_ERROR = {"int8": 0.02, "int4": 0.12}
"""One linear, round-to-nearest on Gaussian weights, groups of 32: int8 ~0.5%, int4 ~8%."""
MODEL_MAX_RELATIVE_ERROR = {"int8": 0.03, "int4": 0.25}
"""Prompt logits of the tiny random model, errors compounded over its layers: measured
int8 ~1%, int4 13%."""


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def random_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    linear = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 1.0)
    return linear


def without_pagoda_kernels(monkeypatch) -> None:
    """As on a machine where the kernel library cannot be built (no C compiler)."""
    monkeypatch.setattr(quantization, "kernels_available", lambda dtype=None: False)
    monkeypatch.setattr(model_loader, "load_cpu_kernels", lambda: None)


def test_torch_int4_kernel_multiplies_by_the_q4_1_weights(monkeypatch) -> None:
    """PyTorch's int4 kernel (the fallback) gets scale d and zero m + 8d from the re-found
    Q4_1 codes, so it multiplies by exactly the GGUF file's weights."""
    without_pagoda_kernels(monkeypatch)
    torch.manual_seed(0)
    weight, _, _ = gguf_like_weight("q4", 96, 128)
    linear = QuantizedLinear(weight, None, "int4", dense_from_rows=None)
    assert linear.kernel == "torch-int4"
    x = torch.randn(3, 128)
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-5)


def test_the_kernel_follows_the_activation_dtype(monkeypatch) -> None:
    """float32 takes Pagoda's kernel on every CPU with a C compiler (CI has one), bf16 where
    the CPU has AVX-512 BF16 (see test_cpu_kernels.py); other dtypes, and every dtype where
    the library cannot be built, PyTorch's int4 kernel or, for int8, a dense matmul."""
    fast_bf16 = "pagoda" if kernels_available(torch.bfloat16) else None
    assert choose_kernel("int4", torch.float32) == choose_kernel("int8", torch.float32) == "pagoda"
    assert choose_kernel("int4", torch.bfloat16) == (fast_bf16 or "torch-int4")
    assert choose_kernel("int8", torch.bfloat16) == (fast_bf16 or "dense")
    assert choose_kernel("int4", torch.float16) == "torch-int4"
    without_pagoda_kernels(monkeypatch)
    assert choose_kernel("int4", torch.float32) == "torch-int4"
    assert choose_kernel("int8", torch.float32) == "dense"


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_float_linear(method, dtype) -> None:
    """Each kernel: Pagoda's (bf16), PyTorch's int4 and the dense int8 fallback (float32)."""
    torch.manual_seed(0)
    linear = random_linear(256, 384, bias=True)
    quantized = QuantizedLinear(linear.weight.to(dtype), linear.bias.to(dtype), method,
                                dense_from_rows=None)
    x = torch.randn(4, 256)
    reference = F.linear(x, linear.weight, linear.bias)  # (4, 384)
    y = quantized(x.to(dtype))
    assert y.shape == (4, 384) and y.dtype == dtype
    assert relative_error(y, reference) < MAX_RELATIVE_ERROR[method]
    assert quantized(x.view(2, 2, 256).to(dtype)).shape == (2, 2, 384)
    # The bias is really applied: without it the output is far off.
    assert relative_error(y - linear.bias.to(dtype), reference) > 0.5
    # Only codes and scales are kept (plus the bias): no float weight.
    assert quantized.dense_weight is None
    assert quantized.kernel == choose_kernel(method, dtype)
    assert quantized.codes.dtype != dtype or quantized.kernel == "dense"


def test_float32_kernel_keeps_no_float_weight_at_any_batch_size() -> None:
    """Pagoda's float32 kernel: large batches multiply by the weight dequantized on the fly
    (ops.DEQUANTIZE_FROM_ROWS), so the layer holds codes and scales only, and a large batch
    gives what the same rows give one small batch at a time."""
    torch.manual_seed(0)
    linear = random_linear(128, 64, bias=False)
    quantized = QuantizedLinear.from_linear(linear, "int4")
    assert quantized.kernel == "pagoda" and quantized.dense_weight is None
    many = torch.randn(40, 128)
    by_fours = torch.cat([quantized(rows) for rows in many.split(4)])
    torch.testing.assert_close(quantized(many), by_fours, rtol=1e-5, atol=1e-5)
    assert relative_error(quantized(many), F.linear(many, linear.weight)) < MAX_RELATIVE_ERROR["int4"]


def test_large_batches_take_the_float_weight(monkeypatch) -> None:
    """Where a kernel keeps the float weight (PyTorch's, and Pagoda's bf16 one): from
    dense_from_rows rows on the matmul is F.linear with the float weight, exactly; below,
    the quantized kernel (which differs from it)."""
    without_pagoda_kernels(monkeypatch)
    torch.manual_seed(0)
    linear = random_linear(128, 64, bias=False)
    quantized = QuantizedLinear.from_linear(linear, "int4", dense_from_rows=4)
    assert quantized.dense_weight is linear.weight
    few, many = torch.randn(3, 128), torch.randn(4, 128)
    assert torch.equal(quantized(many), F.linear(many, linear.weight))
    assert not torch.equal(quantized(few), F.linear(few, linear.weight))
    assert relative_error(quantized(few), F.linear(few, linear.weight)) < MAX_RELATIVE_ERROR["int4"]


def test_merged_linear_with_bias_keeps_each_part() -> None:
    """Qwen2's fused qkv with a bias: every part's rows and bias survive quantization."""
    torch.manual_seed(0)
    merged = MergedLinear(64, {"q": 64, "k": 32, "v": 32}, bias=True)
    for shard_id, size in {"q": 64, "k": 32, "v": 32}.items():
        merged.weight.weight_loader(merged.weight, torch.randn(size, 64) * 0.1, shard_id)
        merged.bias.weight_loader(merged.bias, torch.randn(size) + 3.0, shard_id)
    x = torch.randn(2, 64)
    reference = F.linear(x, merged.weight, merged.bias)
    for method in ("int8", "int4"):
        y = QuantizedLinear.from_linear(merged, method, dense_from_rows=None)(x)
        assert relative_error(y, reference) < MAX_RELATIVE_ERROR[method]


def test_quantization_needs_whole_groups_and_tiles() -> None:
    with pytest.raises(ValueError, match="input sizes by 32; this layer is 48 -> 16"):
        QuantizedLinear(torch.randn(16, 48), None, "int4")
    with pytest.raises(ValueError, match="unknown quantization method 'int2'"):
        QuantizedLinear(torch.randn(16, 64), None, "int2")


def quantized_tiny_model(arch: str, folder: str, method: str,
                         dtype: torch.dtype = torch.float32) -> nn.Module:
    build_checkpoint(arch, folder)
    checkpoint = open_checkpoint(resolve_model_files(folder))
    return load_model(checkpoint, dtype, torch.device("cpu"), max_position=256,
                      quantization=method)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_model_conversion_keeps_a_float_embedding_and_follows_float32(tmp_path, method) -> None:
    """Qwen2 (qkv bias, tied embeddings): every decoder Linear is quantized, the embedding
    table stays float (the head multiplies by its int8 copy), and prompt logits follow the
    float32 model."""
    model = quantized_tiny_model("qwen2", str(tmp_path), method)
    assert not [name for name, m in model.named_modules() if isinstance(m, Linear)]
    quantized = [m for m in model.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 2 * 4 and {m.method for m in quantized} == {method}
    assert model.lm_head is None and model.model.embed_tokens.weight.dtype == torch.float32

    runner = ModelRunner(model, torch.device("cpu"), torch.float32, CacheConfig(block_size=4), [])
    runner.initialize_kv_cache([64] * runner.num_kv_cache_groups)
    for layer in quantized:
        layer.dense_weight = None  # prompts have more rows than dense_from_rows
    float_logits = pagoda_runner(str(tmp_path)).prompt_logits(PROMPTS)
    for ours, reference in zip(runner.prompt_logits(PROMPTS), float_logits):
        assert ours.dtype == torch.float32 and ours.shape == reference.shape
        # (A random tiny model's top logits are near ties: int4's error flips many argmaxes,
        # so top-1 agreement is only asked of int8; real text is in test_fidelity.py.)
        if method == "int8":
            assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.85
        assert relative_error(ours, reference) < MODEL_MAX_RELATIVE_ERROR[method]


def test_untied_head_stays_float_without_pagodas_kernel(tmp_path, monkeypatch) -> None:
    without_pagoda_kernels(monkeypatch)
    model = quantized_tiny_model("llama", str(tmp_path), "int4")
    assert type(model.lm_head) is Linear and model.quantized_head is None
    assert not [n for n, m in model.named_modules() if type(m) is Linear and n != "lm_head"]


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=needs_bf16_kernels)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_models_get_an_int8_logits_head_where_the_kernel_runs(tmp_path, arch, dtype) -> None:
    """The logits head (untied lm_head, or the tied embedding table) runs int8 through
    Pagoda's kernel; its logits follow the float head's."""
    model = quantized_tiny_model(arch, str(tmp_path), "int4", dtype)
    head = model.quantized_head
    assert isinstance(head, QuantizedLinear) and head.method == "int8" and head.kernel == "pagoda"
    hidden = torch.randn(3, 64, dtype=dtype)
    logits = model.compute_logits(hidden)
    reference = F.linear(hidden.float(), model.logits_head_weight().float())
    assert logits.dtype == torch.float32
    assert relative_error(logits, reference) < MAX_RELATIVE_ERROR["int8"]
    model.quantized_head = None
    assert not torch.equal(model.compute_logits(hidden), logits)  # the int8 head was used


def test_config_accepts_the_quantization_choices_only() -> None:
    assert ModelConfig().quantization == "auto"
    for choice in ("auto", "none", None, "int8", "int4"):
        assert ModelConfig(quantization=choice).quantization == choice
    with pytest.raises(ValueError, match="quantization must be None or one of auto, none, int8, "
                                         "int4, got 'int2'"):
        ModelConfig(quantization="int2")


def test_auto_runs_a_gguf_in_its_own_types_where_the_kernels_build(tmp_path, monkeypatch) -> None:
    """auto: the GGUF file's own quantized types on a CPU where Pagoda's kernels build (the
    float32 kernels run on every CPU; any run dtype); float weights for a safetensors model,
    for none/None, on other devices, and where the kernels cannot be built."""
    cpu = torch.device("cpu")
    bundled = open_checkpoint(resolve_model_files(None))
    assert bundled.layer_weight_type() == "Q4_1"
    assert resolve_quantization("auto", bundled, cpu) == GGUF_OWN_TYPES
    assert resolve_quantization("auto", bundled, torch.device("meta")) is None
    for choice in ("none", None):
        assert resolve_quantization(choice, bundled, cpu) is None
    assert resolve_quantization("int8", bundled, cpu) == "int8"
    build_checkpoint("llama", str(tmp_path))
    safetensors = open_checkpoint(resolve_model_files(str(tmp_path)))
    assert resolve_quantization("auto", safetensors, cpu) is None
    without_pagoda_kernels(monkeypatch)
    assert resolve_quantization("auto", bundled, cpu) is None


def test_quantization_refuses_other_devices() -> None:
    check_quantization_supported("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="int4 runs on CPU only.*cuda"):
        check_quantization_supported("int4", torch.device("cuda"))
    with pytest.raises(ValueError, match="one of int8, int4, got 'fp8'"):
        check_quantization_supported("fp8", torch.device("cpu"))


def test_cli_rejects_unknown_quantization() -> None:
    result = run_cli("generate", "--quantization", "int2", "hi")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--quantization: invalid choice: 'int2'" in result.stderr and "int4" in result.stderr


@pytest.mark.slow
def test_cli_quantization_on_a_non_cpu_device_is_a_one_line_error() -> None:
    result = run_cli("generate", "--quantization", "int4", "--device", "meta", "hi")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pagoda: error:")]
    assert len(errors) == 1 and "CPU only" in errors[0], result.stderr


@pytest.mark.slow
def test_int4_engine_answers_a_chat_prompt() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(quantization="int4", kv_cache_memory=64 * 1024 * 1024, max_model_len=512)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    head = llm.engine.runner.model.quantized_head  # int8 where Pagoda's kernel runs it
    assert len(layers) == 4 * 30 + (head is not None) and head in [None, *layers]
    assert {m.method for m in layers} == ({"int4", "int8"} if head else {"int4"})
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text


def test_layers_are_quantized_as_their_last_tensor_loads_in_any_order() -> None:
    """A sharded checkpoint may split a layer between files: layer 0's tensors come before
    and after layer 1's here, and layer 0 is quantized only after its last one."""
    from pagoda.executor.loader.model_loader import quantize_layers_as_loaded

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = Linear(64, 32)

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([Layer(), Layer()])
    names = ["model.layers.0.a", "model.layers.1.a", "model.norm.weight", "model.layers.0.b",
             "model.layers.1.b"]
    seen = []
    for name, _ in quantize_layers_as_loaded(((n, None) for n in names), names, model, "int8"):
        seen.append((name, [type(layer.proj).__name__ for layer in model.model.layers]))
    assert seen[3] == ("model.layers.0.b", ["Linear", "Linear"])  # not before its last tensor
    assert [type(layer.proj) for layer in model.model.layers] == [QuantizedLinear] * 2

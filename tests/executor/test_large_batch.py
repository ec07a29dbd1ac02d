"""Large batches (prefill chunks) over packed weights in float32 or bfloat16: the choice
(kernels/large_batch.py: a measurement where it is `auto`, never a CPU name), the runner
setting it on every packed linear but the logits head, and a prefill taking the bf16 path.
The bf16 product itself: test_gguf_packed.py; its fidelity: test_fidelity.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from pagoda.config import CacheConfig, EngineConfig, ModelConfig
from pagoda.executor.kernels import large_batch, ops
from pagoda.executor.layers.packed_linear import PackedLinear
from pagoda.executor.runner_builder import build_runner


def test_explicit_choices_and_dtypes_need_no_measurement(monkeypatch) -> None:
    monkeypatch.setattr(large_batch, "bf16_speedup", lambda: pytest.fail("measured"))
    resolve = large_batch.resolve_prefill_dtype
    assert resolve("float32", "auto") == torch.float32
    assert resolve("bfloat16", "float32") == torch.bfloat16
    assert resolve("auto", "float32") == torch.float32  # an explicit float32 run stays float32
    assert resolve("auto", "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="prefill_dtype must be"):
        resolve("float16", "auto")


@pytest.mark.parametrize("speedup, chosen", [(1.0, torch.float32), (1.49, torch.float32),
                                             (1.5, torch.bfloat16), (5.0, torch.bfloat16)])
def test_auto_takes_bf16_only_where_it_measures_clearly_faster(monkeypatch, speedup,
                                                                chosen) -> None:
    monkeypatch.setattr(large_batch, "bf16_speedup", lambda: speedup)
    assert large_batch.resolve_prefill_dtype("auto", "auto") == chosen


def test_the_measurement_times_both_products() -> None:
    """A real (small) timing: a finite positive ratio. Its value is this CPU's."""
    speedup = large_batch.bf16_speedup((16, 64, 32), repeats=1)
    assert math.isfinite(speedup) and speedup > 0


def test_config_refuses_bad_prefill_dtypes() -> None:
    with pytest.raises(ValueError, match="prefill_dtype must be one of"):
        ModelConfig(prefill_dtype="int8")
    with pytest.raises(ValueError, match="deterministic runs float32"):
        ModelConfig(deterministic=True, prefill_dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_prefill_runner():
    config = EngineConfig(model=ModelConfig(prefill_dtype="bfloat16", max_model_len=512),
                          cache=CacheConfig(kv_cache_memory=32 << 20))
    return build_runner(config)[0]


def test_the_runner_sets_bf16_on_every_packed_linear_but_the_head(bf16_prefill_runner) -> None:
    model = bf16_prefill_runner.model
    head = model.quantized_head
    linears = [m for m in model.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(m.large_batch_dtype == torch.bfloat16 for m in linears)
    assert isinstance(head, PackedLinear) and head.large_batch_dtype == torch.float32


def test_a_long_prefill_multiplies_in_bf16(bf16_prefill_runner, monkeypatch) -> None:
    """A 200-token prompt's logits at every position: every packed linear of the stack takes
    the bf16 large-batch path, the head float32's, and the logits stay close to float32's."""
    seen = []
    dequantized_matmul = ops.dequantized_matmul
    monkeypatch.setattr(ops, "dequantized_matmul", lambda x, n, f, dtype=torch.float32: (
        seen.append(dtype), dequantized_matmul(x, n, f, dtype))[1])
    prompt = list(range(100, 300))
    logits = bf16_prefill_runner.prompt_logits([prompt])[0]
    layers = bf16_prefill_runner.model.config.num_hidden_layers
    assert seen.count(torch.bfloat16) == 4 * layers and seen.count(torch.float32) == 1
    monkeypatch.setattr(ops, "dequantized_matmul", dequantized_matmul)
    for linear in bf16_prefill_runner.model.modules():
        if isinstance(linear, PackedLinear):
            monkeypatch.setattr(linear, "large_batch_dtype", torch.float32)
    reference = bf16_prefill_runner.prompt_logits([prompt])[0]
    assert not torch.equal(logits, reference)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1),
                                    log_target=True, reduction="batchmean")
    assert kl < 0.01


def test_the_start_line_names_the_prefill_dtype(caplog) -> None:
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=256),
                          cache=CacheConfig(kv_cache_memory=32 << 20))
    with caplog.at_level(logging.INFO, logger="pagoda.executor.runner_builder"):
        build_runner(config)
    assert "prefill matmuls in float32" in caplog.text

"""Faster modes against the float32 run on real text: top-1 agreement and perplexity delta."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.config import CacheConfig
from pagoda.executor.fidelity import compare_teacher_forced
from pagoda.executor.layers import quantization
from pagoda.executor.layers.quantization import Int8LogitsHead
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.loader.tokenizer import load_tokenizer
from pagoda.executor.model_runner import ModelRunner

pytestmark = pytest.mark.slow

NUM_POSITIONS = 512
TEXT_PATH = os.path.join(os.path.dirname(__file__), "..", "data", "real_text.txt")


def bundled_runner(dtype: torch.dtype, quantization: str | None = None) -> ModelRunner:
    files = resolve_model_files(None)
    model = load_model(
        open_checkpoint(files), dtype, torch.device("cpu"), max_position=1024,
        quantization=quantization,
    )
    runner = ModelRunner(model, torch.device("cpu"), dtype, CacheConfig(), [])
    runner.initialize_kv_cache(NUM_POSITIONS // 16 + 2)
    return runner


@pytest.fixture(scope="module")
def text_token_ids() -> list[int]:
    tokenizer = load_tokenizer(resolve_model_files(None))
    with open(TEXT_PATH) as f:
        ids = tokenizer.encode(f.read())
    assert len(ids) > NUM_POSITIONS
    return ids[: NUM_POSITIONS + 1]


@pytest.fixture(scope="module")
def float32_runner() -> ModelRunner:
    return bundled_runner(torch.float32)


def test_bfloat16_follows_float32(float32_runner, text_token_ids) -> None:
    report = compare_teacher_forced(float32_runner, bundled_runner(torch.bfloat16), text_token_ids)
    print(f"\nbfloat16 vs float32: {report}")
    assert report.num_positions == NUM_POSITIONS
    assert report.top1_agreement >= 0.97
    # Real text, a real model: perplexity is finite and far below the vocabulary size.
    assert report.reference_perplexity < 100
    assert abs(report.perplexity_delta) < 0.05 * report.reference_perplexity


def test_int8_follows_float32(float32_runner, text_token_ids) -> None:
    """Dynamic int8 linears with bf16 activations (what `--quantization int8` runs here).

    Below the 97% of bf16 alone: one activation scale per matmul input cannot cover this
    model's outlier channels (see pagoda/executor/layers/quantization.py). Measured on the
    AVX512-VNNI CPU: 85.0% agreement, perplexity 24.29 -> 25.69 (+5.8%). With the 7-bit
    activations of CPUs without VNNI (REDUCE_RANGE): 68.0%, +36.9%. Without the outlier-row
    split: 60.0%, +64.9%, so the bars below catch its loss on either kind of CPU."""
    candidate = bundled_runner(torch.bfloat16, quantization="int8")
    head = candidate.model.lm_head
    assert isinstance(head, Int8LogitsHead)
    # 512 rows would take the float head; force int8, as decode steps of <= 128 rows run.
    head.max_int8_rows = None
    report = compare_teacher_forced(float32_runner, candidate, text_token_ids)
    print(f"\nint8 (bf16 activations) vs float32: {report}, "
          f"perplexity {report.perplexity_delta / report.reference_perplexity:+.1%}")
    assert report.num_positions == NUM_POSITIONS
    min_agreement, max_perplexity_rise = (0.64, 0.45) if quantization.REDUCE_RANGE else (0.82, 0.08)
    assert report.top1_agreement >= min_agreement
    assert abs(report.perplexity_delta) < max_perplexity_rise * report.reference_perplexity


def test_comparison_detects_a_broken_model(float32_runner, text_token_ids) -> None:
    """The measure itself must be able to fail: noise on the weights breaks agreement."""
    broken = bundled_runner(torch.float32)
    with torch.no_grad():
        for layer in broken.model.model.layers[:4]:
            layer.mlp.down_proj.weight.add_(torch.randn_like(layer.mlp.down_proj.weight))
    report = compare_teacher_forced(float32_runner, broken, text_token_ids)
    assert report.top1_agreement < 0.9
    assert report.candidate_perplexity > report.reference_perplexity

"""The dtype a large batch (a prefill chunk) is multiplied in over packed weights, chosen for
this CPU by measurement.

From ops.DEQUANTIZE_FROM_ROWS rows on, a packed weight is dequantized a cache-sized slice at
a time and multiplied by torch's matmul (ops.dequantized_matmul). In float32 that matmul
runs at the CPU's float32 FMA rate (~0.3 TFLOP/s on 2 cores of any kind seen). In bfloat16
(x and the weights rounded to bf16, products summed in float32, the result rounded to bf16)
oneDNN runs AMX tiles where the CPU has them, ~1.7 TFLOP/s on the same 2 cores, and an
emulation slower than float32 where the CPU has no bf16 arithmetic (AVX2, ARM without BF16).
So the rate is a fact of the CPU, found by timing both on a prefill-sized product once per
process, never by a CPU name (BENCHMARKS.md section 25).

Fidelity: bf16 large batches round what a float32 prefill multiplies (x, the dequantized
weights, each product's sum) to 8 bits of mantissa, finer than llama.cpp's own prefill,
which quantizes activations to 8-bit integers per block of 32; tests/executor/test_fidelity.py
holds the mode to the bf16 bar.

`prefill_dtype` (ModelConfig): "float32", "bfloat16", or "auto": bfloat16 where it measures
at least BF16_MIN_SPEEDUP times float32's rate and `dtype` is auto; an explicit
`--dtype float32` keeps float32 arithmetic everywhere (the mode the oracle tests compare).
"""

from __future__ import annotations

import functools
import time

import torch

BF16_MIN_SPEEDUP = 1.5
"""bf16 large batches only where they measure this much faster than float32: a margin over
the timing noise of a shared machine, and over the dequantization both share (so that a
CPU near the border takes float32 run after run, not one or the other)."""
MEASURED_SHAPE = (256, 2048, 1024)
"""(rows, inputs, outputs) timed: a prefill chunk of a 1B model times one dequantized slice
(ops.DEQUANTIZE_SLICE_BYTES)."""
REPEATS = 5


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up: oneDNN builds its kernel for the shape on first use
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def bf16_speedup(shape: tuple[int, int, int] = MEASURED_SHAPE, repeats: int = REPEATS) -> float:
    """float32's time over bf16's for x (rows, inputs) @ w (inputs, outputs), each the best of
    `repeats`, bf16 including x's rounding and the result's widening; measured once per
    process (about 0.1 s where bf16 is native, up to ~0.5 s where it is emulated)."""
    rows, inputs, outputs = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=generator)
    w = torch.randn(inputs, outputs, generator=generator)
    w_bf16 = w.to(torch.bfloat16)
    float32 = _best_seconds(lambda: torch.mm(x, w), repeats)
    bfloat16 = _best_seconds(lambda: torch.mm(x.to(torch.bfloat16), w_bf16).float(), repeats)
    return float32 / bfloat16


def resolve_prefill_dtype(prefill_dtype: str, dtype: str) -> torch.dtype:
    """ModelConfig's prefill_dtype and dtype (names, as configured) -> the dtype packed
    weights' large batches are multiplied in."""
    if prefill_dtype == "float32":
        return torch.float32
    if prefill_dtype == "bfloat16":
        return torch.bfloat16
    if prefill_dtype != "auto":
        raise ValueError(f"prefill_dtype must be auto, float32 or bfloat16, got {prefill_dtype!r}")
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        return torch.float32
    return torch.bfloat16 if bf16_speedup() >= BF16_MIN_SPEEDUP else torch.float32

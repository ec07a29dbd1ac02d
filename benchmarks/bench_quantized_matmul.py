"""Microseconds per call of the quantized matmuls against oneDNN's bf16 matmul, SmolLM2's
layer shapes, bf16 activations, weights hot in cache (a model's weights are not: see the
decode-step figures in BENCHMARKS.md for what reaches a real step).

    .venv/bin/python benchmarks/bench_quantized_matmul.py [--rows 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from pagoda.executor.kernels.ops import gemm_q
from pagoda.executor.kernels.packing import GROUP_K, pack, quantize_groups
from pagoda.executor.layers.quantization import INT4_INNER_K_TILES, torch_int4_scales_and_zeros

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}


def microseconds(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'layer':8} {'rows':>4} {'bf16':>8} {'int4':>8} {'int8':>8} {'torch int4':>10}")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * 0.05
        q4, q8 = quantize_groups(weight, "q4"), quantize_groups(weight, "q8")
        packed4, packed8 = pack(q4), pack(q8)
        dense = q4.dequantize().bfloat16()
        torch_codes = torch._convert_weight_to_int4pack_for_cpu(q4.codes.int(), INT4_INNER_K_TILES)
        torch_scales = torch_int4_scales_and_zeros(q4).bfloat16()
        calls = 20 if name == "head" else 200
        for rows in args.rows:
            x = torch.randn(rows, in_features).bfloat16()
            timings = [microseconds(fn, calls) for fn in (
                partial(F.linear, x, dense),
                partial(gemm_q, x, *packed4, "q4", out_features),
                partial(gemm_q, x, *packed8, "q8", out_features),
                partial(torch._weight_int4pack_mm_for_cpu, x, torch_codes, GROUP_K, torch_scales),
            )]
            print(f"{name:8} {rows:4d} " + " ".join(f"{t:8.0f}" for t in timings[:3])
                  + f" {timings[3]:10.0f}", flush=True)


if __name__ == "__main__":
    main()

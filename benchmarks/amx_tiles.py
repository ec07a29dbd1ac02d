"""AMX tiles against the vector kernel for integer-activation products (gemm_amx.c against
gemm_int8.c), per weight format and row count: the median of `--repeats` timings of each,
interleaved, on one weight of a 1B model's shape (random GGUF blocks), one thread.

    .venv/bin/python benchmarks/amx_tiles.py [--rows 4 8 12 16 32] [--parts 2]

Needs a CPU that lends AMX tiles (Sapphire Rapids or later Xeons); elsewhere it says so and
exits 2. What `auto` picks at start is the same comparison on the model's own weights
(kernels/arithmetic.py resolve_amx_rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import gguf
import numpy as np
import torch

from pagoda.executor.kernels import abi, ops
from pagoda.executor.kernels.packed_weight import gemm_packed
from pagoda.executor.loader.gguf_packing import pack_gguf

Q = gguf.GGMLQuantizationType
FORMATS = {"q4_0": (Q.Q4_0, [0]), "q4_k": (Q.Q4_K, [0, 2]), "q6_k": (Q.Q6_K, [208])}
"""name: (GGUF type, byte offsets of each block's float16 scales)"""


def random_weight(ggml_type, scale_offsets: list[int], n: int, k: int):
    """A packed (n, k) weight of random GGUF blocks: random codes, float16 scales ~ 0.01."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(n * k // block_size, type_size), dtype=np.uint8)
    for offset in scale_offsets:
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return pack_gguf(blocks.reshape(n, -1), ggml_type, (n, k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 32])
    parser.add_argument("--parts", type=int, default=2, choices=[1, 2],
                        help="8-bit parts of each activation (2: --decode-activations int16)")
    parser.add_argument("--outputs", type=int, default=1024)
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    lib = ops.load_cpu_kernels()
    if lib is None or lib.pagoda_amx_available() != 1:
        print("amx_tiles.py: this CPU (or its kernel) lends no AMX tiles", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    print(f"{args.outputs} x {args.inputs} weight, {args.parts}-part activations, 1 thread")
    for name, (ggml_type, scale_offsets) in FORMATS.items():
        packed = random_weight(ggml_type, scale_offsets, args.outputs, args.inputs)
        format = abi.weight_format(packed.format)
        for rows in args.rows:
            x = torch.randn(rows, args.inputs)
            times = {0: [], 1: []}
            for _ in range(args.repeats):
                for min_rows in (0, 1):  # 0: the vector kernel, 1: tiles from one row on
                    lib.pagoda_set_amx_min_rows(format, min_rows)
                    start = time.perf_counter()
                    for _ in range(30):
                        gemm_packed(x, packed, activation_parts=args.parts)
                    times[min_rows].append((time.perf_counter() - start) / 30 * 1e3)
            lib.pagoda_set_amx_min_rows(format, 0)
            vector, tiles = statistics.median(times[0]), statistics.median(times[1])
            print(f"{name} {rows:3d} rows: vector {vector:.3f} ms, tiles {tiles:.3f} ms, "
                  f"{vector / tiles:.2f}x")


if __name__ == "__main__":
    main()

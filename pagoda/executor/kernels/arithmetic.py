"""What packed weights are multiplied in, by batch size, chosen for this CPU by measurement
(never by a CPU name): float32 activations everywhere is the exact mode; two faster ones
round what they multiply, each at least as finely as llama.cpp's own run of the same file.

Large batches (prefill chunks; from ops.DEQUANTIZE_FROM_ROWS rows): a packed weight is
dequantized a cache-sized slice at a time and multiplied by torch's matmul
(ops.dequantized_matmul), in float32 (the CPU's FMA rate, ~0.3 TFLOP/s on 2 cores of any
kind seen) or in bfloat16 (x and the weights rounded to bf16, float32 sums rounded to bf16):
oneDNN runs AMX tiles where the CPU has them (~1.7 TFLOP/s on the same 2 cores) and an
emulation slower than float32 where it has no bf16 arithmetic (AVX2, most ARM).

Small batches (decode steps): the packed kernels multiply float32 activations by the
weights' codes (gemm_f32.c), or quantize the activations per 32 inputs and sum integer dot
products (gemm_int8.c: VNNI's vpdpbusd, AVX2's vpmaddubsw, ARM's sdot), which decode fewer
instructions per weight where the CPU has those: to 8 bits (llama.cpp's arithmetic: ~0.5 %
relative error a product) or to 16 bits as two 8-bit parts (~2e-5: float32's tokens, the
README's answer included, at nearly 8-bit's speed, the weights' reading being the bound).
Batches of several rows of those integer activations run on AMX tiles (gemm_amx.c: the
same integer sums, the same floats) from the row count where that measures faster, per
weight format (resolve_amx_rows): one tile product covers 16 rows x 16 outputs x 32
inputs, but each group of 32 inputs has its own scales, so every tile product is stored
and scaled by vector code, and the tile store is the bound.

`prefill_dtype` / `decode_activations` (ModelConfig): an explicit value, or "auto": bf16
prefill, 16-bit decode activations, each where it measures clearly faster than float32 on
this CPU (MIN_*) and `dtype` is auto; an explicit `--dtype float32` keeps exact float32
everywhere (the mode the oracle tests compare); 8-bit activations are asked for by name.
The logits head takes float32 large batches and 16-bit decode activations at most
(layers/packed_linear.py's HEAD_ACTIVATION_PARTS). Fidelity bars: tests/executor/test_fidelity.py.
"""

from __future__ import annotations

import functools
import time

import torch

MIN_BF16_SPEEDUP = 1.5
"""bf16 prefill is taken only where its matmul measures this much faster than float32's: a
margin over the timing noise of a shared machine and over the dequantization both share,
so that a CPU near the border takes float32 run after run, not one or the other."""
MIN_INT16_SPEEDUP = 1.1
"""16-bit decode activations only where one row through the model's own weights measures
this much faster than float32 activations. Near the border the choice may differ from one
start to the next; both give float32's tokens (16-bit activations: KL ~5e-8 against
float32, test_fidelity.py), so only the speed differs, by less than the margin."""
MIN_AMX_SPEEDUP = 1.1
"""AMX tiles take a format's products from the fewest rows of AMX_ROW_CANDIDATES at which
they measure this much faster than the vector kernel (and at every larger candidate)."""
AMX_ROW_CANDIDATES = (16, 12, 8)
"""Row counts timed, largest first; fewer rows take the vector kernel (the tiles' fixed cost
a group, decoding the weights' codes and storing the sums, outweighs its savings there)."""
AMX_SAMPLE_BYTES = 32 << 20
"""Per format, the model's weights of it timed: in model order, up to this many bytes."""
ACTIVATION_PARTS = {"float32": 0, "int8": 1, "int16": 2}
"""decode_activations -> PackedLinear.activation_parts (8-bit parts of each activation)"""
PREFILL_SHAPE = (256, 2048, 1024)
"""(rows, inputs, outputs) of the timed prefill product: a chunk of a 1B model times one
dequantized slice (ops.DEQUANTIZE_SLICE_BYTES)."""
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
def bf16_speedup(shape: tuple[int, int, int] = PREFILL_SHAPE, repeats: int = REPEATS) -> float:
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


def int16_speedup(weights: list, repeats: int = 3) -> float:
    """float32 activations' time over 16-bit ones' for one row through every packed weight of
    `weights` (a model's own: a decode step's matmuls, read from memory as decode reads
    them), the best of `repeats` passes each (~0.2 s for a 1B model, ~1.5 s at 8B)."""
    from pagoda.executor.kernels.packed_weight import gemm_packed

    generator = torch.Generator().manual_seed(0)
    rows = {w.in_features: torch.randn(1, w.in_features, generator=generator) for w in weights}

    def step(parts: int) -> None:
        for weight in weights:
            gemm_packed(rows[weight.in_features], weight, activation_parts=parts)

    float32 = _best_seconds(lambda: step(0), repeats)
    int16 = _best_seconds(lambda: step(2), repeats)
    return float32 / int16


def _resolve(name: str, setting: str, dtype: str, choices: tuple[str, str], faster_enough) -> str:
    """`setting` (one of choices or auto) under ModelConfig's `dtype` -> one of `choices`
    (exact, faster): auto takes the faster where dtype is auto and faster_enough() says so."""
    exact, faster = choices
    if setting in choices:
        return setting
    if setting != "auto":
        raise ValueError(f"{name} must be auto, {exact} or {faster}"
                         f"{' (or int8)' if name == 'decode_activations' else ''}, got {setting!r}")
    if dtype != "auto":
        return exact
    return faster if faster_enough() else exact


def resolve_prefill_dtype(prefill_dtype: str, dtype: str) -> torch.dtype:
    """ModelConfig's prefill_dtype and dtype (names, as configured) -> the dtype packed
    weights' large batches are multiplied in (bf16 activations: bf16 under auto)."""
    if prefill_dtype == "auto" and dtype == "bfloat16":
        return torch.bfloat16
    chosen = _resolve("prefill_dtype", prefill_dtype, dtype, ("float32", "bfloat16"),
                      lambda: bf16_speedup() >= MIN_BF16_SPEEDUP)
    return torch.bfloat16 if chosen == "bfloat16" else torch.float32


def resolve_decode_activations(decode_activations: str, dtype: str, weights: list) -> int:
    """ModelConfig's decode_activations and dtype -> the 8-bit parts packed weights' small
    batches quantize their activations to (0: float32 activations). `weights`: the model's
    packed weights, timed where the setting is auto."""
    if decode_activations == "int8":
        return ACTIVATION_PARTS["int8"]
    chosen = _resolve("decode_activations", decode_activations, dtype, ("float32", "int16"),
                      lambda: int16_speedup(weights) >= MIN_INT16_SPEEDUP)
    return ACTIVATION_PARTS[chosen]


def amx_speedup(weights: list, rows: int, parts: int, repeats: int = 3) -> float:
    """The vector kernel's time over AMX tiles' for `rows` rows of `parts`-part activations
    through every packed weight of `weights` (all of one format), the best of `repeats`."""
    from pagoda.executor.kernels.abi import weight_format
    from pagoda.executor.kernels.build import load_cpu_kernels
    from pagoda.executor.kernels.packed_weight import gemm_packed

    lib, format = load_cpu_kernels(), weight_format(weights[0].format)
    generator = torch.Generator().manual_seed(0)
    xs = {w.in_features: torch.randn(rows, w.in_features, generator=generator) for w in weights}

    def product(min_rows: int) -> None:
        lib.pagoda_set_amx_min_rows(format, min_rows)
        for weight in weights:
            gemm_packed(xs[weight.in_features], weight, activation_parts=parts)

    try:
        vector = _best_seconds(lambda: product(0), repeats)
        tiles = _best_seconds(lambda: product(1), repeats)
    finally:
        lib.pagoda_set_amx_min_rows(format, 0)
    return vector / tiles


def resolve_amx_rows(weights: list, parts: int) -> dict[str, int]:
    """Packed format name -> the fewest rows from which AMX tiles take its integer-activation
    products (absent: never), measured on `weights` (the model's) where this CPU lends the
    tiles natively; {} under float32 activations, or without AMX. ~0.1 s a format at 1B."""
    from pagoda.executor.kernels.build import load_cpu_kernels

    lib = load_cpu_kernels()
    if parts == 0 or lib is None or lib.pagoda_amx_available() != 1:
        return {}
    by_format: dict[str, list] = {}
    for weight in weights:
        if weight.format != "q8":  # float32 activations always (gemm_int8.c)
            sample = by_format.setdefault(weight.format, [])
            if sum(w.nbytes() for w in sample) < AMX_SAMPLE_BYTES:
                sample.append(weight)
    chosen = {}
    for format, sample in by_format.items():
        for rows in AMX_ROW_CANDIDATES:
            if amx_speedup(sample, rows, parts) < MIN_AMX_SPEEDUP:
                break
            chosen[format] = rows
    return chosen


def set_amx_rows(min_rows: dict[str, int]) -> None:
    """resolve_amx_rows' choice, set in the kernel library (process-wide: every model of the
    process; formats absent stay off)."""
    from pagoda.executor.kernels.abi import WeightFormat
    from pagoda.executor.kernels.build import load_cpu_kernels

    lib = load_cpu_kernels()
    if lib is None:
        return
    for format in WeightFormat:
        lib.pagoda_set_amx_min_rows(int(format), min_rows.get(format.name.lower(), 0))

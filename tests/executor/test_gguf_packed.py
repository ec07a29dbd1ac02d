"""GGUF tensors packed (pagoda/executor/loader/gguf_packing.py into kernels/packed_weight.py)
against the gguf package's own dequantization: every weight bit for bit, the float32 matmul within float32
rounding of x @ dequantize(W)^T for every row count (1-2 rows: the factored decode path;
3-4; several passes; 130: dequantized slices and a BLAS matmul), embedding rows, the memory
the packed form takes, and row slicing. Random bytes with sane float16 scales are real
blocks of each type; the ISA builds of the float32 kernels are run as test_cpu_kernels.py
runs them, ARM64 under qemu in test_kernels_aarch64.py."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from pagoda.executor.kernels import abi, build, ops
from pagoda.executor.kernels.packed_weight import (
    PackedWeight,
    dequantize_rows,
    dequantize_transposed,
    from_group_quantized,
    gemm_packed,
)
from pagoda.executor.kernels.packing import quantize_groups
from pagoda.executor.loader.gguf_dequant import REFERENCE_DECODED_TYPES
from pagoda.executor.loader.gguf_exact_repacking import EXACT_REPACKING, exact_target
from pagoda.executor.loader.gguf_packing import GGUF_FORMATS, gguf_type_packable, pack_gguf
from pagoda.executor.loader.gguf_writer import random_blocks
from tests.executor.test_cpu_kernels import (
    amx_build,
    isa_build_cache,
    isa_library,
    runnable_builds,
)

Q = gguf.GGMLQuantizationType
TYPES = list(GGUF_FORMATS)
SIZE_RATIO = {Q.Q4_0: 10 / 9, Q.Q4_1: 1.0, Q.Q5_0: 12 / 11, Q.Q5_1: 1.0, Q.Q8_0: 1.0,
              Q.Q4_K: 37 / 36, Q.Q5_K: 45 / 44, Q.Q6_K: 1.0}
"""packed bytes / GGUF bytes: Q4_0 and Q5_0 store their implicit m = -8 d / -16 d; the
K-quants' 6-bit sub-scales and mins take a byte each"""


def case(ggml_type, n: int = 48, k: int = 512, seed: int = 0):
    raw = random_blocks(ggml_type, n, k, seed)
    reference = torch.from_numpy(dequantize(raw, ggml_type).reshape(n, k).astype(np.float32))
    return raw, pack_gguf(raw, ggml_type, (n, k)), reference


def legacy_or_k_shapes(ggml_type):
    """K = 512 for every type, and SmolLM's 576 for the 32-weight blocks"""
    return [(48, 512)] + ([(32, 576)] if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else [])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_packed_gguf_dequantizes_bit_for_bit(ggml_type) -> None:
    for n, k in legacy_or_k_shapes(ggml_type):
        raw, packed, reference = case(ggml_type, n, k)
        assert torch.equal(packed.dequantize(), reference)
        assert torch.equal(dequantize_transposed(packed), reference.T)
        # the bf16 form large batches multiply: each weight rounded to nearest even
        assert torch.equal(dequantize_transposed(packed, dtype=torch.bfloat16),
                           reference.T.to(torch.bfloat16))
        from_torch = pack_gguf(torch.from_numpy(raw.reshape(-1)), ggml_type, (n, k))
        assert torch.equal(from_torch.dequantize(), reference)


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within float32 rounding: each error against sum_k |x_k w_k| of its output."""
    bound = 1e-5 * (x.abs() @ weight.abs().T) + 1e-30
    assert ((y - x @ weight.T).abs() <= bound).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_packed_matmul_matches_the_dequantized_one(ggml_type) -> None:
    for n, k in legacy_or_k_shapes(ggml_type):
        _, packed, reference = case(ggml_type, n, k, seed=1)
        for rows in (1, 2, 3, 4, 7, ops.DEQUANTIZE_FROM_ROWS + 2):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            assert_matmul_close(gemm_packed(x, packed), x, reference)


def test_large_batches_dequantize_slice_by_slice(monkeypatch) -> None:
    monkeypatch.setattr(ops, "DEQUANTIZE_SLICE_BYTES", 4 * 512 * 16)  # 16 outputs a slice
    _, packed, reference = case(Q.Q5_K, seed=2)
    x = torch.randn(ops.DEQUANTIZE_FROM_ROWS, 512)
    assert_matmul_close(gemm_packed(x, packed), x, reference)


@pytest.mark.parametrize("slice_outputs", [16, None], ids=["sliced", "whole"])
def test_large_batches_in_bf16_are_the_bf16_product(monkeypatch, slice_outputs) -> None:
    """large_batch_dtype bfloat16: x and the weights rounded to bf16, each output what
    torch's bf16 matmul of those gives (a float32 sum rounded once), slice by slice or
    whole; fewer rows than ops.DEQUANTIZE_FROM_ROWS stay in the float32 kernel."""
    if slice_outputs:
        monkeypatch.setattr(ops, "DEQUANTIZE_SLICE_BYTES", 4 * 512 * slice_outputs)
    _, packed, reference = case(Q.Q4_K, seed=4)
    w_t = reference.T.to(torch.bfloat16)
    x = torch.randn(ops.DEQUANTIZE_FROM_ROWS + 5, 512, generator=torch.Generator().manual_seed(4))
    y = gemm_packed(x, packed, large_batch_dtype=torch.bfloat16)
    assert y.dtype == torch.float32
    width = slice_outputs or packed.out_features
    expected = torch.cat([(x.to(torch.bfloat16) @ w_t[:, i:i + width]).float()
                          for i in range(0, packed.out_features, width)], dim=1)
    assert torch.equal(y, expected)
    assert not torch.equal(y, gemm_packed(x, packed))  # bf16 differs from float32 ...
    bound = 2e-2 * (x.abs() @ reference.abs().T)  # ... by bf16's rounding of inputs and sums
    assert ((y - x @ reference.T).abs() <= bound).all()
    small = x[: ops.DEQUANTIZE_FROM_ROWS - 1]
    assert torch.equal(gemm_packed(small, packed, large_batch_dtype=torch.bfloat16),
                       gemm_packed(small, packed))


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as gemm_int8.c quantizes it to 8 bits, per 32 inputs: (x's 8-bit
    approximation dx * xq, the largest rounding error dx / 2 of each input), both (M, K)."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    xq = torch.round(groups * torch.where(amax > 0, 127.0 / amax, 0.0))  # ties to even
    dx = amax / 127.0
    return (xq * dx).view_as(x), (dx / 2).expand_as(groups).reshape_as(x)


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        ggml_type) -> None:
    """The 8-bit-activation product: x's 8-bit approximation times the weights, to float32
    rounding of its partial sums (whose scale is the codes' and mins' magnitudes: up to ~4x
    the weights' for Q4_0); so within the activations' rounding of x @ W^T. Q8_0 weights
    take the float32 kernel (x @ W^T to float32 rounding)."""
    if ggml_type == Q.Q8_0:
        assert_matmul_close(y, x, weight)
        return
    x_hat, rounding = quantized_activations(x)
    exact = x_hat.double() @ weight.double().T
    assert ((y - exact).abs() <= 1e-4 * (x_hat.abs() @ weight.abs().T) + 1e-30).all()
    assert ((y - x @ weight.T).abs() <= 1.01 * (rounding @ weight.abs().T) + 1e-6).all()
    assert not torch.equal(y, x @ weight.T)


def assert_int16_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """16-bit activations (two 8-bit parts): x's rounding error at most dx / 512 (the second
    part's step dx / 256), 128 times finer than 8 bits', plus float32 rounding."""
    _, rounding_8_bit = quantized_activations(x)
    bound = 1.01 * (rounding_8_bit / 256) @ weight.abs().T + 2e-6 * (x.abs() @ weight.abs().T)
    assert ((y - x @ weight.T).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_integer_activations_multiply_their_approximation(ggml_type) -> None:
    """gemm_int8.c, 8- and 16-bit activations: every format, 1 to 19 rows (passes of 1-4
    rows and of 8)."""
    for n, k in legacy_or_k_shapes(ggml_type):
        _, packed, reference = case(ggml_type, n, k, seed=5)
        for rows in (1, 2, 3, 4, 5, 9, 19):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x[0, :32] = 0.0  # an all-zero group quantizes to zeros (dx = 0)
            assert_int8_product(gemm_packed(x, packed, activation_parts=1), x, reference,
                                ggml_type)
            assert_int16_product(gemm_packed(x, packed, activation_parts=2), x, reference)


@pytest.fixture(scope="module")
def isa_libraries(tmp_path_factory) -> dict:
    """Each x86 instruction-set build this CPU runs (test_cpu_kernels.runnable_builds), the
    packed gemm's functions of it; the builds test_cpu_kernels compiles (isa_build_cache)."""
    libraries = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
        for name in runnable_builds():
            if name != "native":
                library = build.build_library(extra_flags=build.ISA_BUILDS[name])
                libraries[name] = abi.declare(ctypes.CDLL(str(library)))
    return libraries


@pytest.mark.slow  # (kernel builds for other CPUs)
@pytest.mark.parametrize("isa", [b for b in runnable_builds() if b != "native"])
def test_every_format_on_every_instruction_set_build(isa_libraries, isa, monkeypatch) -> None:
    """Every type dequantized and multiplied (1, 2, 4, 5 and 11 rows; float32 and integer
    activations: each build's dot4, gemm_int8.c) by each ISA build."""
    lib = isa_libraries[isa]
    monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    for ggml_type in TYPES:
        _, packed, reference = case(ggml_type, 32, 256, seed=3)
        assert torch.equal(packed.dequantize(), reference), ggml_type.name
        assert torch.equal(dequantize_transposed(packed, dtype=torch.bfloat16),
                           reference.T.to(torch.bfloat16)), ggml_type.name
        for rows in (1, 2, 4, 5, 11):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            assert_matmul_close(gemm_packed(x, packed), x, reference)
            assert_int8_product(gemm_packed(x, packed, activation_parts=1), x, reference,
                                ggml_type)
            assert_int16_product(gemm_packed(x, packed, activation_parts=2), x, reference)


@pytest.mark.slow  # (kernel builds for other CPUs)
@pytest.mark.parametrize("isa", sorted({"amx-emulated", amx_build()}))
def test_amx_tiles_give_the_vector_kernels_floats(isa, tmp_path_factory, monkeypatch) -> None:
    """gemm_amx.c against gemm_int8.c of the same build, bit for bit: every integer format,
    8- and 16-bit activations, 1 to 35 rows (blocks of 16 rows, a partial last one), 16 and
    18 groups (batches of 4 groups, a partial last one)."""
    lib = isa_library(isa, tmp_path_factory)
    assert lib.pagoda_amx_available() == (2 if isa == "amx-emulated" else 1)
    monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    for ggml_type in TYPES:
        if ggml_type == Q.Q8_0:
            continue  # float32 activations always
        for n, k in legacy_or_k_shapes(ggml_type):
            _, packed, reference = case(ggml_type, n, k, seed=7)
            format = abi.weight_format(packed.format)
            for rows in (1, 3, 16, 17, 35):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                x[0, :32] = 0.0
                for parts in (1, 2):
                    try:
                        lib.pagoda_set_amx_min_rows(format, 1)
                        tiles = gemm_packed(x, packed, activation_parts=parts)
                    finally:
                        lib.pagoda_set_amx_min_rows(format, 0)
                    vector = gemm_packed(x, packed, activation_parts=parts)
                    assert torch.equal(tiles, vector), (ggml_type.name, k, rows, parts)
                    if parts == 1:
                        assert_int8_product(tiles, x, reference, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_embedding_rows_and_memory(ggml_type) -> None:
    raw, packed, reference = case(ggml_type)
    rows = torch.tensor([0, 47, 16, 5, 5, 31])
    assert torch.equal(dequantize_rows(packed, rows), reference[rows])
    assert dequantize_rows(packed, torch.tensor([], dtype=torch.long)).shape == (0, 512)
    assert packed.nbytes() / raw.nbytes == pytest.approx(SIZE_RATIO[ggml_type])
    assert packed.nbytes() <= 1.12 * raw.nbytes


def test_rows_and_cat_round_trip() -> None:
    _, packed, reference = case(Q.Q6_K)
    parts = [packed.rows(0, 16), packed.rows(16, 16), packed.rows(16, 48)]
    assert torch.equal(parts[2].dequantize(), reference[16:48])
    assert parts[0].planes["codes"].data_ptr() == packed.planes["codes"].data_ptr()  # views
    joined = PackedWeight.cat(parts)
    assert joined.out_features == 48 and joined.nbytes() == packed.nbytes()
    assert torch.equal(joined.dequantize(), reference)
    with pytest.raises(ValueError, match="multiples of 16"):
        packed.rows(0, 20)
    with pytest.raises(ValueError, match="one format"):
        PackedWeight.cat([packed, case(Q.Q4_K)[1]])


def test_group_quantized_weights_pack_as_q4_and_q8() -> None:
    torch.manual_seed(0)
    for format in ("q4", "q8"):
        quantized = quantize_groups(torch.randn(32, 96) * 0.05, format)
        packed = from_group_quantized(quantized)
        assert packed.format == format
        assert torch.equal(packed.dequantize(), quantized.dequantize())
        x = torch.randn(2, 96)
        assert_matmul_close(gemm_packed(x, packed), x, quantized.dequantize())


def test_big_tensors_pack_slice_by_slice(monkeypatch) -> None:
    from pagoda.executor.loader import gguf_packing
    monkeypatch.setattr(gguf_packing, "PACK_SLICE_WEIGHTS", 16 * 256)  # 16 rows a slice
    raw, _, reference = case(Q.Q4_0, 48, 256)
    assert torch.equal(pack_gguf(raw, Q.Q4_0, (48, 256)).dequantize(), reference)


@pytest.mark.parametrize("ggml_type", sorted(EXACT_REPACKING), ids=lambda t: t.name)
def test_types_another_format_holds_pack_bit_for_bit_in_it(ggml_type, monkeypatch) -> None:
    """Q3_K, IQ3_S and TQ2_0 as Q6_K, IQ4_NL and MXFP4 as Q8_0 (gguf_exact_repacking.py),
    slice by slice: every weight what the spec decodes, bit for bit (float32 and the bf16
    form), the size the target format's, and the product the target format's kernels'."""
    from pagoda.executor.loader import gguf_packing
    monkeypatch.setattr(gguf_packing, "PACK_SLICE_WEIGHTS", 16 * 512)  # 3 slices of 16 rows
    _, packed, reference = case(ggml_type)
    target = EXACT_REPACKING[ggml_type]
    assert packed.format == GGUF_FORMATS[target]
    assert torch.equal(packed.dequantize(), reference)
    assert torch.equal(dequantize_transposed(packed, dtype=torch.bfloat16),
                       reference.T.to(torch.bfloat16))
    assert packed.nbytes() == case(target)[1].nbytes()
    x = torch.randn(3, 512)
    assert_matmul_close(gemm_packed(x, packed), x, reference)


def test_mxfp4_scales_outside_float16_shift_into_the_codes_or_requantize() -> None:
    """MXFP4's scale 2^(e - 128) as a float16 Q8_0 scale: above 2^15 up to 3 bits move into
    the codes (12 * 8 <= 127), still exact; below 2^-24 no float16 holds it, and the tensor
    is requantized to Q8_0 like the types no format holds."""
    raw = random_blocks(Q.MXFP4, 32, 64)
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = 128 + 18  # 2^18: 2^15 in float16, the codes times 8
    reference = torch.from_numpy(dequantize(raw, Q.MXFP4).reshape(32, 64))
    assert torch.equal(pack_gguf(raw, Q.MXFP4, (32, 64)).dequantize(), reference)
    assert exact_target(Q.MXFP4, raw) == Q.Q8_0
    blocks[0, 0] = 128 - 25
    assert exact_target(Q.MXFP4, raw) is None
    q8_0 = gguf.quants.quantize(dequantize(raw, Q.MXFP4), Q.Q8_0)
    assert torch.equal(pack_gguf(raw, Q.MXFP4, (32, 64)).dequantize(),
                       torch.from_numpy(dequantize(q8_0, Q.Q8_0).reshape(32, 64)))


@pytest.mark.parametrize("ggml_type", sorted(REFERENCE_DECODED_TYPES - EXACT_REPACKING.keys()),
                         ids=lambda t: t.name)
def test_types_without_a_kernel_pack_as_their_values_requantized_to_q8_0(ggml_type,
                                                                         monkeypatch) -> None:
    """Q2_K, IQ4_XS, the 1- and 2-bit i-quants, IQ3_XXS, TQ1_0, NVFP4: packed as Q8_0 blocks
    of the values the spec decodes (slice by slice), within Q8_0's rounding of them, and the
    packed matrix multiplies as those Q8_0 weights."""
    from pagoda.executor.loader import gguf_packing
    monkeypatch.setattr(gguf_packing, "PACK_SLICE_WEIGHTS", 16 * 512)  # 3 slices of 16 rows
    _, packed, reference = case(ggml_type)
    assert packed.format == "q8"
    q8_0 = gguf.quants.quantize(reference.numpy(), Q.Q8_0)
    as_q8_0 = torch.from_numpy(dequantize(q8_0, Q.Q8_0).reshape(reference.shape))
    assert torch.equal(packed.dequantize(), as_q8_0)
    # half a code step of each block's d = max / 127, plus d's own float16 rounding (a
    # relative 2^-11, or half a subnormal step, 2^-25) times up to 127 codes
    d = reference.abs().reshape(-1, 32).amax(-1, keepdim=True) / 127
    bound = d / 2 + 127 * torch.maximum(d * 2.0**-11, torch.tensor(2.0**-25))
    assert ((as_q8_0 - reference).abs().reshape(-1, 32) <= bound * 1.0001).all()
    x = torch.randn(3, 512)
    assert_matmul_close(gemm_packed(x, packed), x, as_q8_0)


def test_shapes_the_kernels_cannot_tile_are_refused_clearly() -> None:
    assert gguf_type_packable(Q.Q4_K, (32, 512)) and not gguf_type_packable(Q.Q4_K, (32, 576))
    assert not gguf_type_packable(Q.Q4_0, (40, 64)) and not gguf_type_packable(Q.F16, (32, 512))
    with pytest.raises(ValueError, match=r"multiple of 16 and in_features of 256"):
        pack_gguf(np.zeros(20 * 2 * 144, np.uint8), Q.Q4_K, (20, 512))
    with pytest.raises(ValueError, match=r"multiple of 16 and in_features of 256"):
        pack_gguf(np.zeros(32 * 144 * 9 // 4, np.uint8), Q.Q4_K, (32, 576))
    with pytest.raises(ValueError, match="does not hold|is not the uint8 bytes"):
        pack_gguf(np.zeros(100, np.uint8), Q.Q8_0, (16, 64))
    with pytest.raises(ValueError, match="no packed kernel format"):
        pack_gguf(np.zeros(16 * 256 * 2, np.uint8), Q.F16, (16, 256))
    _, packed, _ = case(Q.Q8_0)
    assert gemm_packed(torch.empty(0, 512), packed).shape == (0, 48)
    with pytest.raises(ValueError, match="contiguous float32"):
        gemm_packed(torch.randn(2, 256), packed)

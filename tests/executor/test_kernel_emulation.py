"""The emulation builds against the native ones: where this CPU has the instructions, a
kind's emulation build (portable code with the same arithmetic: csrc/avx512_emulated.h,
vec_f32.h's forced width) must compute bit for bit what the native build computes, for it
is what CPUs without them prove that path with; and $PAGODA_KERNEL_ISA picks the build."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend
from pagoda.executor.kernels import abi, build, ops
from pagoda.executor.kernels.build import build_library
from pagoda.executor.kernels.ops import gemm_q
from pagoda.executor.kernels.packing import pack, quantize_groups
from tests.executor.test_attention_backend import run_step
from tests.executor.test_cpu_kernels import (
    CPU_FLAGS,
    ON_X86,
    SMOLLM_HEADS,
    X86_FEATURES,
    isa_build_cache,
    isa_library,
    needs_bf16_kernels,
)

pytestmark = pytest.mark.slow  # (make test-fast skips it)


def bf16_kernel_outputs(seed: int) -> list[torch.Tensor]:
    """What the bf16 kernels (whichever build ops calls) make of fixed inputs: the matmul in
    both formats at row counts that take every pass shape, and attention over a paged cache
    (decodes, a prefill, grouped queries)."""
    outputs = []
    for format in ("q4", "q8"):
        for rows in (1, 2, 5, 8, 13, 16, 21):
            torch.manual_seed(seed + rows)
            codes, scales, mins = pack(quantize_groups(torch.randn(64, 256) * 0.05, format))
            outputs.append(gemm_q(torch.randn(rows, 256).bfloat16(), codes, scales, mins,
                                  format, 64))
    for heads in (SMOLLM_HEADS, (8, 1, 128)):
        out, _ = run_step([(7, 1), (0, 5), (130, 1), (33, 1)], heads=heads, seed=seed,
                          backend_class=CpuKernelAttentionBackend, dtype=torch.bfloat16,
                          block_size=16, num_blocks=64)
        outputs.append(out)
    return outputs


@needs_bf16_kernels
def test_the_emulated_bf16_build_equals_the_native_one_bit_for_bit(tmp_path_factory,
                                                                     monkeypatch) -> None:
    """The emulation build is what CPUs without AVX-512 BF16 test the bf16 path with: it is
    only a proof if it computes exactly what vdpbf16ps, vcvtneps2bf16 and friends compute."""
    native = bf16_kernel_outputs(seed=5)
    lib = isa_library("avx512bf16-emulated", tmp_path_factory)
    monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    emulated = bf16_kernel_outputs(seed=5)
    for index, (a, b) in enumerate(zip(native, emulated)):
        assert torch.equal(a, b), f"output {index}: max difference {(a - b).abs().max()}"


def test_the_kernel_build_is_chosen_by_pagoda_kernel_isa(monkeypatch, tmp_path) -> None:
    """$PAGODA_KERNEL_ISA names a build (what the end-to-end tests of every CPU kind use); a
    wrong name is an error naming the choices, not a silent native build."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGODA_KERNEL_ISA", "avx512bf16-emulated")
    assert build.isa_build_flags() == build.EMULATE_AVX512_BF16
    monkeypatch.setenv("PAGODA_KERNEL_ISA", "avx9000")
    build.load_cpu_kernels.cache_clear()
    try:
        with pytest.raises(ValueError, match="avx512bf16-emulated"):
            build.load_cpu_kernels()
    finally:
        monkeypatch.delenv("PAGODA_KERNEL_ISA")
        build.load_cpu_kernels.cache_clear()


def float32_kernel_outputs(seed: int) -> list[torch.Tensor]:
    """The float32 kernels' results on fixed inputs: matmul (both formats, every pass
    shape) and attention (decodes, grouped queries)."""
    outputs = []
    for format in ("q4", "q8"):
        for rows in (1, 3, 4, 7):
            torch.manual_seed(seed + rows)
            codes, scales, mins = pack(quantize_groups(torch.randn(64, 256) * 0.05, format))
            outputs.append(gemm_q(torch.randn(rows, 256), codes, scales, mins, format, 64))
    for heads in (SMOLLM_HEADS, (8, 1, 128)):
        outputs.append(run_step([(7, 1), (0, 1), (130, 1), (33, 1)], heads=heads, seed=seed,
                                backend_class=CpuKernelAttentionBackend, dtype=torch.float32,
                                block_size=16, num_blocks=64)[0])
    return outputs


AVX512F_EMULATED_ON_AVX2 = ("-march=haswell", *build.ISA_BUILDS["avx512f-emulated"])
"""The AVX-512F width's emulation build as an AVX2-only CPU compiles it."""
CAN_COMPARE_WITH_AVX512F = ON_X86 and X86_FEATURES["avx512f"] <= CPU_FLAGS


@pytest.mark.skipif(not CAN_COMPARE_WITH_AVX512F, reason="needs AVX-512F to compare with")
def test_the_emulated_avx512f_width_equals_the_native_build_bit_for_bit(tmp_path_factory,
                                                                         monkeypatch) -> None:
    """What an AVX2-only CPU runs as its proof of the AVX-512F path (16-lane portable vectors
    lowered to AVX2) computes exactly what AVX-512F does."""
    results = []
    for flags in (build.ISA_BUILDS["avx512f"], AVX512F_EMULATED_ON_AVX2):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
            lib = abi.declare(ctypes.CDLL(str(build_library(extra_flags=flags))))
        assert lib.pagoda_f32_vector_bytes() == 64
        monkeypatch.setattr(ops, "load_cpu_kernels", lambda lib=lib: lib)
        results.append(float32_kernel_outputs(seed=6))
    for index, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"output {index}: max difference {(a - b).abs().max()}"

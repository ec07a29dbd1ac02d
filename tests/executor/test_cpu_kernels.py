"""Pagoda's C kernels (pagoda/executor/kernels/csrc/) against torch references: the
group-quantized matmul in both formats and every row count, its dequantized large-batch
path, the packing that re-finds GGUF Q4_1 / Q8_0 codes, and attention over a scattered paged
cache (decodes, prefills, chunked prefills, sliding window).

Each test runs in both activation dtypes the library has: float32 (gemm_f32.c,
attention_f32.c: every CPU with a C compiler, which CI has) and bfloat16 (avx512_bf16.c) two
ways: natively where the CPU has AVX-512 BF16, and through its emulation build
(csrc/avx512_emulated.h: portable code with the instructions' arithmetic) on every CPU, so
the bf16 path is proven whatever CPU CI draws; where the CPU has the instructions, the two
builds must agree bit for bit. The float32 kernels are also built for every instruction set
this CPU can run (generic 4-lane vectors, AVX2, AVX-512F, native) and each build is tested;
ARM64 builds are tested under qemu in test_kernels_aarch64.py."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda.executor.attention.cpu_backend import CpuKernelAttentionBackend, select_backend
from pagoda.executor.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from pagoda.executor.kernels import abi, build, ops
from pagoda.executor.kernels.build import build_library, cpu_flags
from pagoda.executor.kernels.ops import gemm_q, kernels_available, paged_attention
from pagoda.executor.kernels.packing import GROUP_K, pack, quantize_groups
from tests.executor.test_attention_backend import run_step

pytestmark = pytest.mark.slow  # (make test-fast skips it)

CPU_FLAGS = set(cpu_flags().split())
CPU_HAS_AVX512_BF16 = "avx512_bf16" in CPU_FLAGS
needs_bf16_kernels = pytest.mark.skipif(not CPU_HAS_AVX512_BF16,
                                        reason="this CPU lacks AVX-512 BF16")
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16_kernels), "bfloat16-emulated"]
"""Kernel paths of the `dtype` fixture (indirect): float32, bf16 on this CPU's instructions,
bf16 through the emulation build (any CPU)."""
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

X86_FEATURES = {  # build.ISA_BUILDS name: CPU features the build needs to run
    "generic": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512f": {"avx512f", "avx512bw", "avx512vl"},
}
ON_X86 = platform.machine() in ("x86_64", "AMD64")


def test_the_kernels_build_and_run_here() -> None:
    """A build error or a missing kernel is a regression, not a silent fallback: float32
    everywhere, bf16 exactly where the CPU has AVX-512 BF16."""
    assert build_library().exists()
    assert kernels_available(torch.float32)
    assert kernels_available(torch.bfloat16) == CPU_HAS_AVX512_BF16


@pytest.mark.skipif(not ON_X86, reason="x86 instruction sets")
def test_a_build_without_avx512_bf16_says_so_and_exports_no_bf16_kernel(tmp_path_factory,
                                                                         monkeypatch) -> None:
    """What a CPU without the feature gets: the float32 kernels, the bf16 availability
    check (0) and no bf16 kernel symbols (abi.declare checks before declaring any). The
    generic x86-64 build lacks AVX-512 BF16 on every CPU (and the session compiles it
    anyway, for the run tests below)."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
    lib = ctypes.CDLL(str(build_library(extra_flags=build.ISA_BUILDS["generic"])))
    assert lib.pagoda_bf16_kernels_available() == 0
    assert lib.pagoda_gemm_q_f32 is not None
    with pytest.raises(AttributeError):
        lib.pagoda_gemm_q_bf16  # noqa: B018


EVERY_X86_PATH = [("-march=x86-64",), ("-march=haswell",), ("-march=skylake-avx512",),
                  ("-march=sapphirerapids",), build.ISA_BUILDS["avx512bf16-emulated"]]
"""The builds whose compiling is tested on x86 (tests/background_builds.py compiles them ahead)."""


@pytest.mark.skipif(not ON_X86, reason="x86 instruction sets")
@pytest.mark.parametrize("flags", EVERY_X86_PATH)
def test_every_x86_instruction_set_path_compiles(flags, tmp_path_factory, monkeypatch) -> None:
    """Each per-ISA piece compiles, including those this CPU cannot run (the run tests below
    cover what it can, on these same builds)."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
    assert build_library(extra_flags=flags).exists()


def isa_build_cache(tmp_path_factory) -> Path:
    """The session's own kernel cache for instruction-set builds: each build (its flags and
    sources are in its cache key) is compiled once however many tests use it."""
    return tmp_path_factory.getbasetemp() / "isa-builds"


def runnable_builds() -> list:
    """The float32 builds this CPU runs: its own, each x86 kind's it can run natively, the
    AVX-512F and AVX2 widths' emulation builds (portable vectors: any CPU) where it cannot
    run that kind (where it can, the emulation build is the same source at the same width as
    the native one, which is tested instead; test_kernel_emulation.py holds the 16-lane one
    bit-equal to AVX-512F), and on x86 ARM64's (NEON's width and fused multiply-adds)."""
    native = ([name for name, needs in X86_FEATURES.items() if needs <= CPU_FLAGS]
              if ON_X86 else [])
    builds = ["native", *(f"{kind}-emulated" for kind in ("avx512f", "avx2")
                          if kind not in native)]
    builds += native
    if ON_X86 and "fma" in CPU_FLAGS:  # ARM64's path (its contractions need the host's FMA)
        builds.append("arm64-emulated")
    return builds


def amx_build() -> str:
    """The build that runs gemm_amx.c's tiles here: this CPU's own where it lends them, else
    their emulation build (csrc/amx_emulated.h)."""
    native = build.load_cpu_kernels()
    return "native" if native is not None and native.pagoda_amx_available() == 1 else "amx-emulated"


def isa_library(name: str, tmp_path_factory) -> ctypes.CDLL:
    """build.ISA_BUILDS[name] of the library, declared; compiled once per session."""
    if name == "native":
        return build.load_cpu_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
        return abi.declare(ctypes.CDLL(str(build_library(
            extra_flags=build.ISA_BUILDS[name]))))


@pytest.fixture(params=runnable_builds())
def isa_build(request, tmp_path_factory, monkeypatch):
    """The float32 kernels as one instruction-set build of the library, which ops then call.
    Yields the vector width in bytes."""
    lib = isa_library(request.param, tmp_path_factory)
    monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    yield lib.pagoda_f32_vector_bytes()


@pytest.fixture
def dtype(request, tmp_path_factory, monkeypatch) -> torch.dtype:
    """The activation dtype of a kernel test (parametrized indirectly by DTYPES); for
    "bfloat16-emulated", ops call the emulation build of the bf16 kernels."""
    if request.param == "bfloat16-emulated":
        lib = isa_library("avx512bf16-emulated", tmp_path_factory)
        assert lib.pagoda_bf16_kernels_available() == 2
        monkeypatch.setattr(ops, "load_cpu_kernels", lambda: lib)
    return torch.float32 if request.param == "float32" else torch.bfloat16


def gguf_like_weight(format: str, out_features: int, in_features: int):
    """A weight as GGUF's Q4_1 / Q8_0 quantizers leave it: float16 scales, each group's
    codes reaching the extremes (Q4_1: 0 and 15; Q8_0: +-127)."""
    groups = in_features // GROUP_K
    d = (torch.rand(out_features, groups) * 0.01 + 0.001).half().float()
    if format == "q4":
        codes = torch.randint(0, 16, (out_features, groups, GROUP_K))
        codes[..., 0], codes[..., 1] = 0, 15
        m = (-torch.rand(out_features, groups) * 0.1).half().float()
        weight = d[..., None] * codes + m[..., None]
    else:
        codes = torch.randint(-127, 128, (out_features, groups, GROUP_K))
        codes[..., 0] = 127 * torch.where(torch.rand(out_features, groups) < 0.5, 1, -1)
        weight = d[..., None] * codes
    return weight.view(out_features, in_features), codes.view(out_features, in_features), d


@pytest.mark.parametrize("format", ["q4", "q8"])
def test_quantize_groups_recovers_gguf_codes(format) -> None:
    torch.manual_seed(0)
    weight, codes, d = gguf_like_weight(format, 32, 128)
    quantized = quantize_groups(weight, format)
    assert torch.equal(quantized.codes.long(), codes)
    assert torch.equal(quantized.scales.float(), d)
    torch.testing.assert_close(quantized.dequantize(), weight, rtol=0, atol=1e-6)


def gemm_case(format: str, rows: int, dtype: torch.dtype):
    """(kernel output, x @ W^T with W dequantized and rounded to `dtype`, as the kernel
    multiplies it), float32."""
    torch.manual_seed(rows)
    weight = torch.randn(96, 160) * 0.05
    quantized = quantize_groups(weight, format)
    codes, scales, mins = pack(quantized)
    x = torch.randn(rows, 160).to(dtype)
    out = gemm_q(x, codes, scales, mins, format, 96)
    assert out.dtype == dtype and out.shape == (rows, 96)
    return out.float(), x.float() @ quantized.dequantize().to(dtype).float().T


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
@pytest.mark.parametrize("format", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 21])
def test_gemm_q_matches_a_matmul_by_the_dequantized_weight(dtype, format, rows) -> None:
    """Every row count (one float32 pass holds 4 rows; bf16 8 for q4, 16 for q8; 21 takes
    several; float32 from 16 rows dequantizes for a BLAS matmul)."""
    out, expected = gemm_case(format, rows, dtype)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("format", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_float32_kernel_on_every_instruction_set_build(isa_build, format, rows) -> None:
    out, expected = gemm_case(format, rows, torch.float32)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("format", ["q4", "q8"])
def test_large_float32_batches_dequantize_slice_by_slice(format, monkeypatch) -> None:
    """From DEQUANTIZE_FROM_ROWS rows: W^T dequantized (bit-equal to the reference's
    d * q + m) a slice of whole tiles at a time; slices forced small so that several run."""
    monkeypatch.setattr(ops, "DEQUANTIZE_SLICE_BYTES", 4 * 160 * 32)  # 32 outputs a slice
    torch.manual_seed(5)
    quantized = quantize_groups(torch.randn(96, 160) * 0.05, format)
    packed = pack(quantized)
    w_t = ops.dequantize_transposed(*packed, format, 96, 160)
    assert torch.equal(w_t, quantized.dequantize().T)
    x = torch.randn(ops.DEQUANTIZE_FROM_ROWS + 3, 160)
    torch.testing.assert_close(gemm_q(x, *packed, format, 96), x @ w_t, rtol=1e-6, atol=1e-6)


def test_gemm_q_rejects_an_input_it_has_no_kernel_for() -> None:
    quantized = quantize_groups(torch.randn(16, 32), "q8")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gemm_q(torch.randn(2, 32).half(), *pack(quantized), "q8", 16)


def test_packing_rejects_shapes_the_kernel_cannot_tile() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        quantize_groups(torch.randn(20, 64), "q4")


SMOLLM_HEADS = (9, 3, 64)  # query heads, KV heads, head dim


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
@pytest.mark.parametrize(
    "seqs",
    [
        [(40, 1)],  # one stream, several blocks
        [(7, 1), (0, 1), (130, 1), (33, 1)],  # decodes only, lengths off the 16-lane grid
        [(0, 5), (70, 1), (3, 6), (12, 1)],  # decodes (kernel) mixed with prefills (torch)
    ],
)
@pytest.mark.parametrize("heads", [SMOLLM_HEADS, (4, 4, 32), (8, 1, 128)])
def test_kernel_attention_matches_naive_attention(dtype, seqs, heads) -> None:
    out, expected = run_step(seqs, backend_class=CpuKernelAttentionBackend, dtype=dtype,
                             heads=heads, block_size=16, num_blocks=64)
    assert out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("heads", [SMOLLM_HEADS, (8, 1, 128)])
def test_float32_attention_on_every_instruction_set_build(isa_build, heads) -> None:
    out, expected = run_step([(7, 1), (0, 1), (130, 1), (33, 1)], heads=heads, seed=2,
                             backend_class=CpuKernelAttentionBackend, dtype=torch.float32,
                             block_size=16, num_blocks=64)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
def test_kernel_attention_sliding_window(dtype) -> None:
    out, expected = run_step([(50, 1), (9, 1), (2, 9)], window=20, seed=3,
                             backend_class=CpuKernelAttentionBackend, dtype=dtype,
                             heads=SMOLLM_HEADS, block_size=16, num_blocks=64)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("seqs", [[(50, 1), (9, 1), (30, 1)], [(50, 1), (9, 1), (2, 9)]])
def test_kernel_attention_takes_each_layers_window(seqs) -> None:
    """Gemma's interleaved layers: global and sliding layers on one step's metadata, the
    decodes through the kernel with the layer's window; soft-capped layers and layers with
    sinks (gpt-oss), which the kernel cannot do, through the torch path."""
    sinks = torch.tensor([1.0, -2.0, 3.0, 0.0])
    layers = [(None, None), (20, None), (None, 3.0), (20, 3.0), (20, None, sinks),
              (None, None, sinks)]
    results = run_step(seqs, seed=3, backend_class=CpuKernelAttentionBackend,
                       dtype=torch.float32, heads=(4, 2, 32), block_size=16, num_blocks=64,
                       layers=layers)
    for (out, expected), layer in zip(results, layers):
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4,
                                   msg=f"layer {layer[:2]}")


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
def test_kernel_attention_takes_prefill_tokens_against_their_causal_prefix(dtype) -> None:
    """The kernel itself (the backend feeds it decodes only, see cpu_backend.py): a 150-token
    prompt, each token attending keys 0 .. its position, against float32 causal attention."""
    torch.manual_seed(0)
    num_tokens, (heads, kv_heads, dim) = 150, SMOLLM_HEADS
    kv_cache = torch.randn(2, kv_heads, 16, 16, dim).to(dtype)
    table = torch.randperm(16)[:10].view(1, 10)  # scattered blocks
    query = torch.randn(num_tokens, heads, dim).to(dtype)
    out = paged_attention(query, kv_cache, table, torch.zeros(num_tokens, dtype=torch.long),
                          torch.arange(1, num_tokens + 1), dim**-0.5, None)
    keys, values = (kv_cache[i][:, table[0]].reshape(kv_heads, -1, dim)[:, :num_tokens]
                    for i in (0, 1))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys.float(), values.float(), is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
def test_kernel_writes_the_decode_steps_keys_and_values_as_it_attends(dtype) -> None:
    """new_keys: the kernel stores each token's K/V row at its slot (the cache ends up as
    write_kv_cache leaves it, nothing else touched) and attends with it. K/V come as views of
    one fused (tokens, q + k + v) tensor, as the model hands them over."""
    torch.manual_seed(1)
    (heads, kv_heads, dim), seqs, block_size = SMOLLM_HEADS, 5, 16
    kv_cache = torch.randn(2, kv_heads, 24, block_size, dim).to(dtype)
    tables = torch.randperm(24)[:15].view(seqs, 3)  # scattered blocks, 3 per sequence
    key_lens = torch.tensor([1, 17, 40, 33, 48])  # the new token is the last of each
    slots = tables.gather(1, ((key_lens - 1) // block_size).view(-1, 1)).view(-1) * block_size \
        + (key_lens - 1) % block_size
    fused = torch.randn(seqs, (heads + 2 * kv_heads) * dim).to(dtype)
    query, key, value = (t.view(seqs, -1, dim) for t in fused.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    assert not key.is_contiguous()
    expected_cache = kv_cache.clone()
    write_kv_cache(key, value, expected_cache, slots)
    expected = paged_attention(query, expected_cache, tables, torch.arange(seqs), key_lens,
                               dim**-0.5, None)
    out = paged_attention(query, kv_cache, tables, torch.arange(seqs), key_lens, dim**-0.5, None,
                          new_keys=(key, value, slots))
    assert torch.equal(kv_cache, expected_cache)
    assert torch.equal(out, expected)


def test_the_kernel_backend_is_chosen_only_where_it_applies() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend(16, cpu, torch.float32, 9, 3, 64, None),
                      CpuKernelAttentionBackend)
    bf16_backend = select_backend(16, cpu, torch.bfloat16, 9, 3, 64, None)
    assert isinstance(bf16_backend, CpuKernelAttentionBackend) == kernels_available(torch.bfloat16)
    for dtype, heads in [(torch.float16, (9, 3, 64)), (torch.float32, (4, 4, 8))]:
        backend = select_backend(16, cpu, dtype, *heads, None)
        assert type(backend) is TorchAttentionBackend


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_torch(with_residual) -> None:
    """The float32 RMSNorm kernel small batches take, the residual add fused in front."""
    torch.manual_seed(4)
    x, residual, weight = torch.randn(5, 576), torch.randn(5, 576), torch.randn(576)
    out, new_residual = ops.rms_norm(x, weight, 1e-5, residual if with_residual else None)
    summed = x + residual if with_residual else x
    torch.testing.assert_close(out, F.rms_norm(summed, (576,), weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    assert (new_residual is None) != with_residual
    if with_residual:
        assert torch.equal(new_residual, summed)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_cache_attention_on_every_instruction_set_build(isa_build, name) -> None:
    """--kv-cache-dtype float16 / bfloat16 (pagoda_paged_attention_h16_f32: the F16C /
    AVX-512 conversion where the build has it, the portable bit path elsewhere, ARM64's
    width included): decodes that write their keys rounded as torch does and attend."""
    from tests.executor.test_kv_cache_16bit import bits, sixteen_bit_step

    (torch_out, torch_cache), (kernel_out, kernel_cache), expected = sixteen_bit_step(
        [(7, 1), (0, 1), (130, 1), (33, 1)], name, SMOLLM_HEADS)
    assert torch.equal(bits(kernel_cache), bits(torch_cache))
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_out, expected, atol=1e-4, rtol=1e-4)

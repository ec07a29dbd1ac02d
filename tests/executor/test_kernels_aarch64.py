"""The float32 kernels built for ARM64 (NEON: the 4-lane vectors of vec_f32.h) and run under
qemu-user against the same torch references as the native build: the ARM path is tested,
not hoped for. Needs Debian's gcc-aarch64-linux-gnu and qemu-user, which .ci/run installs;
where either is missing these tests are skipped for that reason only."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagoda.executor.kernels import build
from pagoda.executor.kernels.abi import weight_format
from pagoda.executor.kernels.build import SOURCE_DIR, kernel_sources
from pagoda.executor.kernels.packing import pack, quantize_groups
from tests.executor.test_attention_backend import reference_attention
from tests.executor.test_cpu_kernels import CPU_FLAGS, ON_X86, isa_build_cache

CROSS_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"
pytestmark = [pytest.mark.slow,  # (make test-fast skips it)
              pytest.mark.skipif(CROSS_CC is None or QEMU is None,
                                 reason="needs gcc-aarch64-linux-gnu and qemu-user")]


DRIVER_FLAGS = ("-O3", "-march=armv8-a", "-fopenmp")
"""kernel_driver.c with the kernel sources, for ARM64 (-march=armv8-a: NEON)."""
DOTPROD_DRIVER_FLAGS = ("-O3", "-march=armv8.2-a+dotprod", "-fopenmp")
"""The driver for ARM64 with the dot-product extension (sdot in gemm_int8.c's dot4), run
under qemu's `max` CPU, which has it."""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return driver_build(DRIVER_FLAGS, isa_build_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def dotprod_driver(tmp_path_factory) -> Path:
    return driver_build(DOTPROD_DRIVER_FLAGS, isa_build_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def emulating_driver(tmp_path_factory) -> Path:
    """The same driver for this x86 CPU, its kernels the library Pagoda loads as
    build.ISA_BUILDS["arm64-emulated"] (the session's shared build: test_cpu_kernels.py
    runs it too)."""
    if not ON_X86 or "fma" not in CPU_FLAGS:
        pytest.skip("the ARM64 emulation build runs on x86 CPUs with FMA")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(isa_build_cache(tmp_path_factory)))
        library = build.build_library(extra_flags=build.ISA_BUILDS["arm64-emulated"])
    target = tmp_path_factory.mktemp("arm64-emulated") / "kernel_driver"
    subprocess.run(["cc", "-O3", f"-I{SOURCE_DIR}", "-o", str(target),
                    str(Path(__file__).with_name("kernel_driver.c")), str(library),
                    f"-Wl,-rpath,{library.parent}", "-lm"], check=True)
    return target


def driver_build(flags: tuple[str, ...], cache: Path) -> Path:
    """kernel_driver.c and the kernel sources cross-compiled with `flags` into the session's
    build cache (once: tests/background_builds.py may have built it ahead), each source by
    its own process (build.compile_and_link: the cores share the build)."""
    target = cache / f"aarch64-{flags[1].removeprefix('-march=')}" / "kernel_driver"
    target.parent.mkdir(parents=True, exist_ok=True)
    with build.build_lock(target):
        if not target.exists():
            sources = [Path(__file__).with_name("kernel_driver.c"), *kernel_sources()]
            partial = target.with_name("kernel_driver.partial")
            complaint = build.compile_and_link(CROSS_CC, (*flags, f"-I{SOURCE_DIR}"), sources,
                                               partial)
            assert complaint is None, complaint
            partial.replace(target)
    return target


def run(driver: Path, command: str, inputs: list[np.ndarray], tmp_path: Path) -> np.ndarray:
    path_in, path_out = tmp_path / f"{command}.in", tmp_path / f"{command}.out"
    path_in.write_bytes(b"".join(np.ascontiguousarray(a).tobytes() for a in inputs))
    emulator = [] if driver.read_bytes()[18:20] != b"\xb7\x00" else [QEMU, "-L", SYSROOT]
    subprocess.run([*emulator, str(driver), command, str(path_in), str(path_out)],
                   check=True, timeout=300, env={"OMP_NUM_THREADS": "2", "QEMU_CPU": "max"})
    return np.frombuffer(path_out.read_bytes(), dtype=np.float32)


def test_the_arm_build_uses_neon_vectors(driver) -> None:
    """The driver is an ARM64 executable whose kernels took 16-byte NEON vectors."""
    assert driver.read_bytes()[18:20] == b"\xb7\x00"  # ELF e_machine: EM_AARCH64
    disassembly = subprocess.run([CROSS_CC.replace("gcc", "objdump"), "-d", str(driver)],
                                 capture_output=True, text=True, check=True).stdout
    assert "fmla\tv" in disassembly  # vector fused multiply-add on NEON registers


@pytest.mark.parametrize("format", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_gemm_on_arm64_matches_the_dequantized_matmul(driver, tmp_path, format, rows) -> None:
    torch.manual_seed(rows)
    quantized = quantize_groups(torch.randn(96, 160) * 0.05, format)
    codes, scales, mins = pack(quantized)
    x = torch.randn(rows, 160)
    header = np.array([weight_format(format), rows, 160, 96], dtype=np.int64)
    arrays = [header, x.numpy(), codes.numpy(), scales.view(torch.int16).numpy()]
    if mins is not None:
        arrays.append(mins.view(torch.int16).numpy())
    y = run(driver, "gemm", arrays, tmp_path).reshape(rows, 96)
    expected = x @ quantized.dequantize().T
    torch.testing.assert_close(torch.from_numpy(y.copy()), expected, rtol=2e-5, atol=2e-5)
    w_t = run(driver, "dequantize", arrays[:1] + arrays[2:], tmp_path).reshape(160, 96)
    assert torch.equal(torch.from_numpy(w_t.copy()), quantized.dequantize().T)


def packed_case(ggml_type: str, rows: int) -> tuple[list[np.ndarray], torch.Tensor]:
    """The driver's "packed" inputs for a random (32, 256) weight of `ggml_type` and `rows`
    rows of x; and the weight as gguf dequantizes it."""
    from pagoda.executor.kernels.packed_weight import PLANE_NAMES
    from tests.executor.test_gguf_packed import case

    _, packed, reference = case(gguf.GGMLQuantizationType[ggml_type], 32, 256, seed=4)
    planes = [packed.planes[name].contiguous().view(torch.uint8).numpy()
              if name in packed.planes else np.zeros(0, np.uint8) for name in PLANE_NAMES]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    header = np.array([weight_format(packed.format), rows, 256, 32]
                      + [p.nbytes for p in planes], dtype=np.int64)
    return [header, x.numpy(), *planes], reference


@pytest.mark.parametrize("ggml_type", ["Q5_1", "Q4_K", "Q6_K"])
def test_packed_gguf_on_arm64_matches_gguf(driver, tmp_path, ggml_type) -> None:
    """The packed GGUF formats on NEON: the factored 1-2 row path and the 3-4 row one (5
    rows), against gguf's dequantization, bit for bit where it dequantizes; and through 8-
    and 16-bit activations (gemm_int8.c's portable dot products)."""
    for rows in (2, 5):
        check_packed_outputs(driver, tmp_path, ggml_type, rows)


def check_packed_outputs(driver: Path, tmp_path: Path, ggml_type: str, rows: int) -> np.ndarray:
    from tests.executor.test_gguf_packed import assert_int8_product, assert_int16_product

    inputs, reference = packed_case(ggml_type, rows)
    x = torch.from_numpy(inputs[1])
    raw = run(driver, "packed", inputs, tmp_path)
    y, w_t, w_rows, y_int8, y_int16 = torch.from_numpy(raw.copy()).split(
        [rows * 32, 256 * 32, 32 * 256, rows * 32, rows * 32])
    bound = 1e-5 * (x.abs() @ reference.abs().T)
    assert ((y.view(rows, 32) - x @ reference.T).abs() <= bound).all()
    assert torch.equal(w_t.view(256, 32), reference.T)
    assert torch.equal(w_rows.view(32, 256), reference.flip(0))
    assert_int8_product(y_int8.view(rows, 32), x, reference,
                        gguf.GGMLQuantizationType[ggml_type])
    assert_int16_product(y_int16.view(rows, 32), x, reference)
    return raw


def test_the_dotprod_build_takes_sdot_and_gives_the_same_sums(driver, dotprod_driver,
                                                              tmp_path) -> None:
    """ARM64 with the dot-product extension: sdot in the integer kernels, and (the integer
    sums being exact) every output bit for bit the plain NEON build's."""
    disassembly = subprocess.run([CROSS_CC.replace("gcc", "objdump"), "-d", str(dotprod_driver)],
                                 capture_output=True, text=True, check=True).stdout
    assert "sdot\tv" in disassembly
    for ggml_type in ("Q4_0", "Q5_K", "Q4_K", "Q6_K"):
        for rows in (1, 3, 5):
            with_sdot = check_packed_outputs(dotprod_driver, tmp_path, ggml_type, rows)
            inputs, _ = packed_case(ggml_type, rows)
            assert np.array_equal(with_sdot, run(driver, "packed", inputs, tmp_path))


ATTENTION_LENS = [8, 1, 131, 34]
BLOCK_SIZE, NUM_BLOCKS = 16, 40


def attention_case(heads: tuple[int, int, int], window: int | None) -> list:
    """Decode tokens of four sequences over scattered blocks: the driver's "attention"
    inputs, and (query, kv_cache, tables) for the reference."""
    num_heads, num_kv_heads, dim = heads
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, dim, generator=gen)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:4 * 9].view(4, 9)
    query = torch.randn(len(ATTENTION_LENS), num_heads, dim, generator=gen)
    header = np.array([len(ATTENTION_LENS), num_heads, num_kv_heads, dim, NUM_BLOCKS,
                       BLOCK_SIZE, 9, window or 0, len(ATTENTION_LENS)], dtype=np.int64)
    arrays = [header, np.array([dim**-0.5]), query.numpy(), kv_cache.numpy(), tables.numpy(),
              np.arange(len(ATTENTION_LENS), dtype=np.int64),
              np.array(ATTENTION_LENS, dtype=np.int64)]
    return [arrays, (query, kv_cache, tables)]


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128)])
def test_paged_attention_on_arm64_matches_naive_attention(driver, tmp_path, heads, window) -> None:
    """Decode tokens of four sequences over scattered blocks, with and without a window."""
    num_heads, num_kv_heads, dim = heads
    block_size, lens = BLOCK_SIZE, ATTENTION_LENS
    arrays, (query, kv_cache, tables) = attention_case(heads, window)
    out = torch.from_numpy(run(driver, "attention", arrays, tmp_path).copy())
    expected = []
    for seq, length in enumerate(lens):
        pos = torch.arange(length)
        slots = tables[seq, pos // block_size] * block_size + pos % block_size
        keys = kv_cache[0].reshape(num_kv_heads, -1, dim)[:, slots].transpose(0, 1)
        values = kv_cache[1].reshape(num_kv_heads, -1, dim)[:, slots].transpose(0, 1)
        expected.append(reference_attention(query[seq:seq + 1], keys, values, length - 1, window))
    torch.testing.assert_close(out.view(len(lens), num_heads, dim), torch.cat(expected),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                       "Q6_K"])
def test_the_emulation_build_packs_and_multiplies_as_arm64_does(driver, emulating_driver,
                                                                tmp_path, ggml_type) -> None:
    """What every x86 CPU runs as ARM64's path (tests/executor/test_cpu_kinds.py runs it end
    to end) is bit for bit what the ARM64 build computes, every format, 1-5 rows."""
    for rows in (1, 2, 3, 5):
        inputs, _ = packed_case(ggml_type, rows)
        arm64 = run(driver, "packed", inputs, tmp_path)
        assert np.array_equal(run(emulating_driver, "packed", inputs, tmp_path), arm64)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128)])
def test_the_emulation_build_attends_as_arm64_does(driver, emulating_driver, tmp_path, heads,
                                                   window) -> None:
    arrays, _ = attention_case(heads, window)
    arm64 = run(driver, "attention", arrays, tmp_path)
    assert np.array_equal(run(emulating_driver, "attention", arrays, tmp_path), arm64)

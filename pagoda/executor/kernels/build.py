"""Build Pagoda's C kernels (csrc/*.c, one library) on first use and load them with ctypes.

The library is compiled where it runs, with `-march=native`, by the C compiler in $CC (else
`cc`), so each source takes the instruction set this CPU has (csrc/kernels.h lists them),
and cached under $PAGODA_KERNEL_CACHE (else ~/.cache/pagoda/kernels) by a hash of the
sources, the flags and the CPU's feature flags, so a shared home on another CPU rebuilds.
A compiler that refuses `-march=native` or `-fopenmp` gets a build without them (generic
vectors, or one thread). `load_cpu_kernels()` returns None, after one logged warning, where
no compiler builds the library: callers then take PyTorch's kernels.

Load it only after torch: its OpenMP symbols then bind to the libgomp torch loaded, so the
kernels run on torch's thread pool (two pools on the same cores would spin against each
other).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: see the module docstring)

from pagoda.executor.kernels import abi

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-shared", "-fPIC")
OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())
"""Tried in order until one builds: the CPU's own instruction set and torch's thread pool."""

EMULATE_AVX512_BF16 = ("-DPAGODA_EMULATE_AVX512_BF16", "-ffp-contract=off")
"""avx512_bf16.c's emulation build (csrc/avx512_emulated.h): its bf16 kernels on any CPU, in
portable code with the instructions' arithmetic (no contraction of a*b+c into one rounding
where the intrinsics have two)."""
ISA_BUILDS = {
    "native": (),
    "generic": ("-march=x86-64",),
    "avx2": ("-march=haswell",),
    "avxvnni": ("-march=alderlake",),  # AVX2 with AVX-VNNI's 256-bit vpdpbusd (gemm_int8.c)
    "avx512f": ("-march=skylake-avx512",),
    "avx512f-emulated": ("-DPAGODA_F32_VECTOR_BYTES=64",),
    "avx2-emulated": ("-DPAGODA_F32_VECTOR_BYTES=32",),
    # ARM64's NEON path: 4 lanes, products contracted to fused multiply-adds (fmla), as GCC
    # does on ARM64; on x86 -mfma gives the same contractions (the host needs FMA: every
    # x86 kind Pagoda runs on has it). Bit-equal to the ARM64 build run under qemu
    # (tests/executor/test_kernels_aarch64.py).
    # -march=x86-64 overrides the library's -march=native: on a Zen 4 EPYC native let GCC
    # vectorize the portable code's scalar parts its own way, and attention's last bits moved.
    "arm64-emulated": ("-DPAGODA_F32_VECTOR_BYTES=16",
                       *(("-march=x86-64", "-mfma") if platform.machine() in ("x86_64", "AMD64")
                         else ())),
    "avx512bf16-emulated": EMULATE_AVX512_BF16,
    # gemm_amx.c's tile kernel in portable code (csrc/amx_emulated.h) at AVX-512's width
    "amx-emulated": ("-DPAGODA_F32_VECTOR_BYTES=64", "-DPAGODA_EMULATE_AMX"),
}
"""Named builds of the library, for $PAGODA_KERNEL_ISA: the instruction-set paths of the x86
CPU kinds Pagoda runs on (generic SSE2 vectors, AVX2, AVX2 with AVX-VNNI, AVX-512F: each
only where the CPU can run it), and their emulation builds for any CPU, ARM included: the float32 kernels at
AVX-512F's (AVX2's, ARM64 NEON's) vector width in portable vectors, and the bf16 kernels in
portable code (csrc/vec_f32.h, csrc/avx512_emulated.h). "native" (the default) is
what this CPU has. Tests and `pagoda generate` take any of them, so every CPU kind's path
runs end to end from whichever CPU is at hand."""


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (else the processor's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("PAGODA_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pagoda" / "kernels"


def kernel_sources(source_dir: Path = SOURCE_DIR) -> list[Path]:
    return sorted(source_dir.glob("*.c"))


def build_library(source_dir: Path = SOURCE_DIR, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernel sources of `source_dir` into one cached shared library; returns
    its path. Raises RuntimeError naming the compiler's complaint when no flag set builds."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    content = b"".join(p.read_bytes() for p in sorted(source_dir.iterdir()) if p.is_file())
    key = hashlib.sha256(
        content + " ".join((compiler, *BASE_FLAGS, *extra_flags, cpu_flags())).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"pagoda-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):
        if target.exists():  # another process built it while this one waited
            return target
        return _compile_library(compiler, source_dir, extra_flags, target)


@contextlib.contextmanager
def build_lock(target: Path):
    """Held while `target` is built: processes that want the same build at once (data-
    parallel replicas on a fresh cache, tests sharing a build cache) compile it once; the
    others wait, then load the finished file."""
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile_library(compiler: str, source_dir: Path, extra_flags: tuple[str, ...],
                     target: Path) -> Path:
    sources, errors = kernel_sources(source_dir), []
    for optional in OPTIONAL_FLAGS:
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            complaint = compile_and_link(compiler, (*BASE_FLAGS, *optional, *extra_flags),
                                         sources, partial)
            if complaint is None:
                if optional != OPTIONAL_FLAGS[0]:
                    logger.warning("Pagoda's CPU kernels built without %s (the compiler "
                                   "refused them)", " ".join(set(OPTIONAL_FLAGS[0]) - set(optional)))
                partial.replace(target)  # atomic: concurrent builders each install a whole file
                return target
            errors.append(complaint.strip()[-1000:])
        finally:
            partial.unlink(missing_ok=True)
    raise RuntimeError(f"{compiler} failed on {source_dir}: {errors[0]}")


def compile_and_link(compiler: str, flags: tuple[str, ...], sources: list[Path],
                     output: Path) -> str | None:
    """Each source compiled to an object at once (one process each: the cores share the
    build, several minutes of one core for an emulation build), then linked into `output`
    (a shared library where `flags` say -shared, else a program: the tests' ARM64 driver).
    Returns None, or the compiler's complaint."""
    with tempfile.TemporaryDirectory(dir=output.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        jobs = [subprocess.Popen([compiler, *flags, "-c", str(source), "-o", str(obj)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for source, obj in zip(sources, objects)]
        complaints = [job.communicate()[1] for job in jobs]
        failed = [c for job, c in zip(jobs, complaints) if job.returncode != 0]
        if failed:
            return failed[0]
        link = subprocess.run([compiler, *flags, "-o", str(output), *map(str, objects), "-lm"],
                              capture_output=True, text=True, check=False)
        return None if link.returncode == 0 else link.stderr


def isa_build_flags() -> tuple[str, ...]:
    """The compiler flags of the build $PAGODA_KERNEL_ISA names (ISA_BUILDS; unset: native)."""
    name = os.environ.get("PAGODA_KERNEL_ISA") or "native"
    if name not in ISA_BUILDS:
        raise ValueError(f"PAGODA_KERNEL_ISA={name!r} is not a kernel build; choose one of "
                         f"{', '.join(ISA_BUILDS)}")
    return ISA_BUILDS[name]


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built or loaded.
    Its float32 kernels run on any CPU; its bf16 ones where `pagoda_bf16_kernels_available()`
    (AVX-512 BF16, or the emulation build), and only those are declared. $PAGODA_KERNEL_ISA
    picks a named build (ISA_BUILDS); `load_cpu_kernels.cache_clear()` after changing it."""
    if os.environ.get("PAGODA_DISABLE_KERNELS"):
        return None
    try:
        return abi.declare(ctypes.CDLL(str(build_library(extra_flags=isa_build_flags()))))
    except (RuntimeError, OSError) as error:
        logger.warning("Pagoda's CPU kernels are unavailable, using PyTorch's: %s", error)
        return None

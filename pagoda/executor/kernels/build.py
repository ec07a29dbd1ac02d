"""Build Pagoda's C kernels (cpu_kernels.c) on first use and load them with ctypes.

The library is compiled where it runs, with `-march=native`, by the C compiler in $CC (else
`cc`), and cached under $PAGODA_KERNEL_CACHE (else ~/.cache/pagoda/kernels) by a hash of the
source, the flags and the CPU's feature flags, so a shared home on another CPU rebuilds.
`load_cpu_kernels()` returns None, after one logged warning, where there is no compiler or
the CPU lacks AVX-512 BF16: callers then take PyTorch's kernels.

Load it only after torch: its OpenMP symbols then bind to the libgomp torch loaded, so the
kernels run on torch's thread pool (two pools on the same cores would spin against each
other).
"""

from __future__ import annotations

import ctypes
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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


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


def build_library(source: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` into a cached shared library; returns its path.
    Raises RuntimeError naming the compiler's complaint when the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = FLAGS + extra_flags
    key = hashlib.sha256(
        source.read_bytes() + " ".join((compiler, *flags, cpu_flags())).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run([compiler, *flags, "-o", str(partial), str(source)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        partial.replace(target)  # atomic: concurrent builders each install a whole file
    finally:
        partial.unlink(missing_ok=True)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pagoda_kernels_available.restype = ctypes.c_int
    lib.pagoda_gemm_q.restype = None
    lib.pagoda_gemm_q.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.pagoda_paged_attention.restype = None
    lib.pagoda_paged_attention.argtypes = [
        ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
        ptr, ptr, i64, i64, ptr, ptr,
    ]
    return lib


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot run here."""
    if os.environ.get("PAGODA_DISABLE_KERNELS"):
        return None
    try:
        lib = ctypes.CDLL(str(build_library()))
    except (RuntimeError, OSError) as error:
        logger.warning("Pagoda's CPU kernels are unavailable, using PyTorch's: %s", error)
        return None
    if not lib.pagoda_kernels_available():  # built without the kernels: nothing to declare
        logger.warning("this CPU lacks AVX-512 BF16: Pagoda's CPU kernels are off, "
                       "using PyTorch's")
        return None
    return _declare(lib)

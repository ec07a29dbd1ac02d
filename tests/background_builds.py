"""The slow kernel tests' builds, compiled ahead while the earlier tests run.

The suite leaves about a third of its two cores idle (servers waiting on their clients,
clients waiting on servers), and the kernel tests at its end spent minutes compiling: every
instruction-set build of the C kernels, their emulation builds, the ARM64 drivers, and
llama.cpp's llama-quantize. conftest's `ahead_of_time_builds` starts this module as one
process at the lowest CPU priority (SCHED_IDLE: it runs only on a core nothing else wants)
when the session holds those tests; it compiles what they will ask for, in the order they
ask, into the same caches, under the same locks (build.build_lock). A test that needs a
build while it is being compiled waits for it and loads it; one not reached yet it compiles
itself, as without this process. Nothing a test checks depends on it: it only moves the
compiling earlier.

    python -m tests.background_builds ISA_BUILD_CACHE
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

KERNEL_TEST_MODULES = ("test_cpu_kernels.py", "test_cpu_kinds.py", "test_kernel_emulation.py",
                       "test_kernels_aarch64.py", "test_gguf_packed.py", "test_lora_kernel.py",
                       "test_llama_cpp_files.py", "test_moe_kernel.py")
"""tests/executor modules whose builds this process compiles: a session holding none of
them (make test-fast, one module's run) starts no background build."""


def isa_flag_sets() -> list[tuple[str, ...]]:
    """The kernel library's builds the kernel tests compile on this CPU, first use first."""
    from pagoda.executor.kernels import build
    from tests.executor.test_cpu_kernels import EVERY_X86_PATH, ON_X86, amx_build, runnable_builds
    from tests.executor.test_cpu_kinds import PATHS
    from tests.executor.test_kernel_emulation import (
        AVX512F_EMULATED_ON_AVX2,
        CAN_COMPARE_WITH_AVX512F,
    )

    names = [*(["generic"] if ON_X86 else []), "avx512bf16-emulated", *runnable_builds(),
             *(isa for isa, *_ in PATHS.values()), amx_build()]
    flag_sets = [*(EVERY_X86_PATH if ON_X86 else []),
                 *(build.ISA_BUILDS[name] for name in names if name != "native"),
                 *([AVX512F_EMULATED_ON_AVX2] if CAN_COMPARE_WITH_AVX512F else [])]
    return list(dict.fromkeys(flag_sets))  # each once, in first-use order


def build_everything(cache: Path) -> None:
    from pagoda.executor.kernels import build

    flag_sets = isa_flag_sets()  # (builds the native library first, into the user's cache)
    os.environ["PAGODA_KERNEL_CACHE"] = str(cache)
    for flags in flag_sets:
        build.build_library(extra_flags=flags)

    from tests.executor.test_kernels_aarch64 import (
        CROSS_CC,
        DOTPROD_DRIVER_FLAGS,
        DRIVER_FLAGS,
        QEMU,
        driver_build,
    )

    if CROSS_CC and QEMU:
        for flags in (DRIVER_FLAGS, DOTPROD_DRIVER_FLAGS):
            driver_build(flags, cache)

    from tests.llama_cpp_tools import ToolUnavailable, llama_quantize

    if shutil.which("cmake") and shutil.which("c++"):
        try:
            llama_quantize()
        except ToolUnavailable:
            pass  # the test that needs it says why


if __name__ == "__main__":
    from tests.second_lane import lowest_priority

    lowest_priority()
    build_everything(Path(sys.argv[1]))

"""The slow kernel tests' builds, compiled ahead while the earlier tests run.

The suite leaves about a third of its two cores idle (servers waiting on their clients,
clients waiting on servers), and the kernel tests at its end spent minutes compiling: every
instruction-set build of the C kernels, their emulation builds, the ARM64 drivers, and
llama.cpp's llama-quantize. conftest's `ahead_of_time_builds` starts this module as one
process at the lowest CPU priority (`lowest_priority`: it runs only on a core nothing else
wants) when the session holds those tests; it compiles what they will ask for, in the order they
ask, into the same caches, under the same locks (build.build_lock). A test that needs a
build while it is being compiled waits for it and loads it; one not reached yet it compiles
itself, as without this process. Nothing a test checks depends on it: it only moves the
compiling earlier.

    python -m tests.background_builds ISA_BUILD_CACHE MODULE...   (tests/executor file names)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def kernel_builds(module: str) -> list[tuple[str, ...]]:
    """The kernel library's builds (their flags) that tests/executor/`module` compiles on this
    CPU, first use first; [] for a module that compiles none."""
    from pagoda.executor.kernels import build
    from tests.executor.test_cpu_kernels import EVERY_X86_PATH, ON_X86, amx_build, runnable_builds

    def named(*names: str) -> list[tuple[str, ...]]:
        return [build.ISA_BUILDS[name] for name in names if name != "native"]

    if module == "test_cpu_kernels.py":
        return [*(EVERY_X86_PATH if ON_X86 else []), *named(*(["generic"] if ON_X86 else []),
                                                          "avx512bf16-emulated",
                                                          *runnable_builds())]
    if module == "test_cpu_kinds.py":
        from tests.executor.test_cpu_kinds import PATHS

        return named(*(isa for isa, *_ in PATHS.values()), amx_build())
    if module == "test_kernel_emulation.py":
        from tests.executor.test_kernel_emulation import (
            AVX512F_EMULATED_ON_AVX2,
            CAN_COMPARE_WITH_AVX512F,
        )

        return [*named("avx512bf16-emulated"), *([build.ISA_BUILDS["avx512f"],
                                                  AVX512F_EMULATED_ON_AVX2]
                                                 if CAN_COMPARE_WITH_AVX512F else [])]
    if module in ("test_gguf_packed.py", "test_lora_kernel.py", "test_moe_kernel.py",
                  "test_kernels_aarch64.py"):
        return named(*runnable_builds())
    if module == "test_decode_kernel.py":
        return named(amx_build())
    return []


def build_ahead(cache: Path, modules: list[str]) -> None:
    """Compile what `modules` (tests/executor file names, in the session's order) will ask
    for, in that order, two builds at a time (each build compiles its sources at once, but
    one long source ends each: two keep both cores busy)."""
    from concurrent.futures import ThreadPoolExecutor

    from pagoda.executor.kernels import build

    build.load_cpu_kernels()  # the native build first (the user's cache): most tests load it
    flag_sets = list(dict.fromkeys(flags for module in modules for flags in kernel_builds(module)))
    os.environ["PAGODA_KERNEL_CACHE"] = str(cache)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda flags: build.build_library(extra_flags=flags), flag_sets))

    if "test_kernels_aarch64.py" in modules:
        from tests.executor.test_kernels_aarch64 import (
            CROSS_CC,
            DOTPROD_DRIVER_FLAGS,
            DRIVER_FLAGS,
            QEMU,
            driver_build,
        )

        if CROSS_CC and QEMU:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda flags: driver_build(flags, cache),
                              (DRIVER_FLAGS, DOTPROD_DRIVER_FLAGS)))

    if ({"test_llama_cpp_files.py", "test_llama_quantize_files.py"} & set(modules)
            and shutil.which("cmake") and shutil.which("c++")):
        from tests.llama_cpp_tools import ToolUnavailable, llama_quantize

        try:
            llama_quantize()
        except ToolUnavailable:
            pass  # the test that needs it says why


AHEAD_OF = ("test_cpu_kernels.py", "test_cpu_kinds.py", "test_decode_kernel.py",
            "test_gguf_packed.py", "test_kernel_emulation.py", "test_kernels_aarch64.py",
            "test_llama_cpp_files.py", "test_llama_quantize_files.py", "test_lora_kernel.py",
            "test_moe_kernel.py")
"""tests/executor modules whose builds this process compiles: a session holding none of
them (make test-fast, most single-module runs) starts no background build."""


def lowest_priority() -> None:
    """This process and the compilers it starts run only where a core is otherwise idle.
    conftest starts it in a session of its own, and where the kernel shares the CPU between
    sessions first (sched_autogroup, on by default) a task's own policy only ranks it within
    its session: so this session's share is set to the least (autogroup nice 19, a weight of
    15 against a default session's 1024), and the task's policy to SCHED_IDLE. Measured:
    without the autogroup's nice, the builder took a fair share against the servers the tests
    start (each a session of its own), and the A/B suite took 11 minutes instead of 3."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroups: the policy alone ranks it
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        os.nice(19)


if __name__ == "__main__":
    lowest_priority()
    build_ahead(Path(sys.argv[1]), sys.argv[2:])

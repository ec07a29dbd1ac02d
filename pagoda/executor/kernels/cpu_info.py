"""What this CPU offers Pagoda's kernels, and the path `auto` takes on it: for the log line
at start and for `pagoda env`."""

from __future__ import annotations

import os
import platform

import torch

from pagoda.executor.kernels.build import cpu_flags, load_cpu_kernels

FEATURES_OF_INTEREST = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "fphp", "asimdhp", "bf16", "sve",
)
"""/proc/cpuinfo flag names (x86 and ARM) that decide a kernel path."""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_features() -> list[str]:
    """The features of interest this CPU has, in FEATURES_OF_INTEREST's order."""
    flags = set(cpu_flags().split())
    return [name for name in FEATURES_OF_INTEREST if name in flags]


def float32_kernel_isa() -> str | None:
    """The instruction set the float32 kernels were built for here, or None without them."""
    lib = load_cpu_kernels()
    if lib is None:
        return None
    vector_bytes = lib.pagoda_f32_vector_bytes()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        names = {64: "AVX-512F", 32: "AVX2+FMA" if "avx2" in cpu_features() else "AVX"}
        name = names.get(vector_bytes, "SSE2")
    elif machine in ("aarch64", "arm64"):
        name = "NEON"
    else:
        name = "generic vectors"
    return f"{name}, {vector_bytes * 8}-bit vectors"


def describe_kernels() -> str:
    """One line: which kernel paths run here."""
    isa = float32_kernel_isa()
    if isa is None:
        why = ("turned off by PAGODA_DISABLE_KERNELS" if os.environ.get("PAGODA_DISABLE_KERNELS")
               else "unavailable (they did not build: no C compiler?)")
        return f"Pagoda's CPU kernels: {why}, PyTorch's kernels only"
    bf16 = {0: "no (needs AVX-512 BF16)", 1: "yes (AVX-512 BF16)",
            2: "emulated (portable code, for tests: slow)"}[
        load_cpu_kernels().pagoda_bf16_kernels_available()]
    return f"Pagoda's CPU kernels: float32 on {isa}; bfloat16: {bf16}"


def describe_run(dtype: torch.dtype, quantization: str | None, attention: str,
                 arithmetic: tuple[torch.dtype, int, dict[str, int]] | None = None) -> str:
    """The one line logged at start: what runs on this CPU. `arithmetic`: what the packed
    weights' large batches multiply in, the 8-bit parts of small ones' activations (0:
    float32) and the formats AMX tiles take from some row count on (format -> rows); None:
    no packed weights."""
    name = str(dtype).removeprefix("torch.")
    weights = f"{quantization} weights" if quantization else f"{name} weights"
    prefill = ""
    if arithmetic is not None:
        large_batch_dtype, parts, amx_rows = arithmetic
        prefill = (f", prefill matmuls in {str(large_batch_dtype).removeprefix('torch.')}, decode "
                   f"activations {('float32', 'int8', 'int16')[parts]}")
        if amx_rows:
            prefill += " (AMX tiles: " + ", ".join(
                f"{format} from {rows} rows" for format, rows in sorted(amx_rows.items())) + ")"
    return (f"{cpu_name()} ({', '.join(cpu_features()) or 'no vector extensions seen'}), "
            f"{torch.get_num_threads()} threads: {name} activations, {weights}{prefill}, "
            f"attention {attention}; {describe_kernels()}")


def run_info(dtype: torch.dtype, quantization: str | None, attention: str,
             arithmetic: tuple[torch.dtype, int, dict[str, int]] | None = None,
             device: str = "cpu") -> dict:
    """What runs where, as plain data (JSON-ready): for `GET /version`, where a benchmark
    (`pagoda bench ab`) reads the hardware each endpoint ran on. The same facts as
    `describe_run`'s line; `arithmetic` as there."""
    info: dict = {
        "device": device, "cpu": cpu_name(), "cpu_features": cpu_features(),
        "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
        "weights": quantization or str(dtype).removeprefix("torch."), "attention": attention,
        "kernels": describe_kernels(),
    }
    if arithmetic is not None:
        large_batch_dtype, parts, amx_rows = arithmetic
        info.update(prefill_dtype=str(large_batch_dtype).removeprefix("torch."),
                    decode_activations=("float32", "int8", "int16")[parts],
                    amx_tiles_from_rows=dict(sorted(amx_rows.items())))
    return info


def environment_report() -> list[str]:
    """Lines for `pagoda env`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pagoda_version = version("pagoda-llm")
    except PackageNotFoundError:
        pagoda_version = "unknown"
    return [
        f"Pagoda {pagoda_version}, torch {torch.__version__}, Python {platform.python_version()}",
        f"CPU: {cpu_name()} ({platform.machine()}), {len(os.sched_getaffinity(0))} usable cores",
        f"features seen: {' '.join(cpu_features()) or 'none of interest'}",
        describe_kernels(),
    ]

"""llama.cpp's own tools for the tests: convert_hf_to_gguf.py, convert_lora_to_gguf.py (and
llama-quantize, built on demand), so that Pagoda is tested on GGUF files as llama.cpp writes
them, not only as our own writer (pagoda/executor/loader/gguf_writer.py) does.

All come from the sdist of `llama-cpp-python` on PyPI, which vendors a whole llama.cpp tree
(vendor/llama.cpp: the converter, its own gguf-py, the C++ sources). The version is pinned so
that runs are reproducible; the sdist is fetched with pip once and unpacked into a cache
folder kept across runs:

    $PAGODA_LLAMA_CPP_CACHE  or  ~/.cache/pagoda/llama-cpp-python-sdist/
        <version>/llama.cpp/            the unpacked vendor/llama.cpp
        <version>/build/bin/llama-quantize   (once built)

Cold: the download (~77 MB), pip's metadata step and unpacking take 40-60 s; building
llama-quantize without optimisation (the tests quantize tiny models) about 2.5 minutes on 2
cores (see `llama_quantize`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagoda.executor.kernels.build import build_lock

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""llama-cpp-python's sdist version (vendors llama.cpp of its release); bump deliberately."""
CACHE_ENV = "PAGODA_LLAMA_CPP_CACHE"


class ToolUnavailable(RuntimeError):
    """The sdist could not be fetched (no network to PyPI) or a tool could not be built."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "pagoda", "llama-cpp-python-sdist")
    return Path(root) / LLAMA_CPP_PYTHON_VERSION


def _locked(name: str):
    """One process at a time (the session's ahead-of-time builds, parallel test workers)
    fetches or builds into the cache."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    return build_lock(cache_dir() / f".{name}")


def llama_cpp_source() -> Path:
    """The llama.cpp source tree (vendor/llama.cpp of the sdist), fetched on first use."""
    target = cache_dir() / "llama.cpp"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with _locked("source"):
        if (target / "convert_hf_to_gguf.py").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--disable-pip-version-check", "-d", tmp,
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
                capture_output=True, text=True, check=False)
            archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if result.returncode != 0 or not archives:
                raise ToolUnavailable(
                    f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed:\n"
                    f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
            prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
            with tarfile.open(archives[0]) as archive:
                members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
                archive.extractall(tmp, members=members, filter="data")
            # rename last: a half-unpacked tree is never seen as the cache
            os.replace(Path(tmp) / prefix, target)
    return target


# Runs a converter script once per (argv, outfile) job in one Python process (the imports of
# torch and transformers cost more than converting a tiny model); a failed conversion leaves
# its traceback in outfile + ".failed" and the others go on.
_CONVERT_DRIVER = r"""
import json, runpy, sys, traceback
script, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, script.rsplit("/", 1)[0])  # its `conversion` package
for argv, outfile in jobs:
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            open(outfile + ".failed", "w").write(f"exit status {e.code}")
    except Exception:
        open(outfile + ".failed", "w").write(traceback.format_exc())
"""


def _run_converter(script: str, jobs: list[tuple[list[str], str]]) -> dict[str, str]:
    """Run llama.cpp's `script` (in its tree) on each (argv, output path) job, in one
    subprocess of this Python per core (at most two: each imports torch and transformers
    once; the conversions are single-threaded), with the sdist's own gguf-py first on the
    path (the converters go with their own gguf package). Returns {output path: the
    converter's error} for those that failed."""
    source = llama_cpp_source()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(source / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    shares = [jobs[i::2] for i in range(min(2, os.cpu_count() or 1, len(jobs)))]
    failures = {}
    with contextlib.ExitStack() as stack:
        drivers = []
        for share in shares:  # (a log file: a pipe left unread would stall its converter)
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            drivers.append((share, log, subprocess.Popen(
                [sys.executable, "-c", _CONVERT_DRIVER, str(source / script), json.dumps(share)],
                env=env, stdout=subprocess.DEVNULL, stderr=log)))
        for share, log, driver in drivers:
            driver.wait()
            log.seek(0)
            stderr = log.read()
            for _, outfile in share:
                failed = Path(outfile + ".failed")
                if failed.is_file():
                    failures[outfile] = failed.read_text()[-6000:]
                elif not os.path.isfile(outfile):
                    failures[outfile] = (f"no output (exit status {driver.returncode}):\n"
                                         f"{stderr[-6000:]}")
    return failures


def convert(jobs: Sequence[tuple[str, str, str]]) -> dict[str, str]:
    """Run llama.cpp's convert_hf_to_gguf.py on each (Hugging Face folder, outtype (f32, f16,
    bf16, q8_0), output path). Returns {output path: the converter's error} for those that
    failed."""
    return _run_converter("convert_hf_to_gguf.py", [
        ([folder, "--outtype", outtype, "--outfile", outfile], outfile)
        for folder, outtype, outfile in jobs])


def convert_lora(jobs: Sequence[tuple[str, str, str, str]]) -> dict[str, str]:
    """Run llama.cpp's convert_lora_to_gguf.py on each (PEFT adapter folder, the base's
    Hugging Face folder (its config.json is read), outtype (f32, f16, bf16, q8_0), output
    path). Returns {output path: the converter's error} for those that failed."""
    return _run_converter("convert_lora_to_gguf.py", [
        ([adapter, "--base", base, "--outtype", outtype, "--outfile", outfile], outfile)
        for adapter, base, outtype, outfile in jobs])


def llama_quantize(build: bool = True) -> Path:
    """The llama-quantize binary, built once into the cache (CPU only, static, no network
    features, -O0: the same quantization code, compiled 3.5x faster than -O2; the tests
    quantize tiny models). With build=False, raises ToolUnavailable unless it is already
    built; ToolUnavailable too where cmake or a C++ compiler is missing. The build: 2 min
    17 s on 2 idle cores (3 min of CPU; -O2 took 10.5 min of CPU)."""
    binary = cache_dir() / "build" / "bin" / "llama-quantize"
    if binary.is_file():
        return binary
    if not build:
        raise ToolUnavailable(f"{binary} is not built")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ToolUnavailable(f"{tool} is not installed")
    source = llama_cpp_source()
    with _locked("build"):
        if binary.is_file():
            return binary
        build_dir = cache_dir() / "build"
        jobs = str(max(1, min(os.cpu_count() or 1, 8)))
        for command in (
            ["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
             "-DCMAKE_C_FLAGS_RELEASE=-O0", "-DCMAKE_CXX_FLAGS_RELEASE=-O0",
             "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
            ["cmake", "--build", str(build_dir), "-j", jobs, "--target", "llama-quantize"],
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:  # asked to build: a failure is an error, not a skip
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return binary


def quantize(source: str, target: str, type_name: str, binary: Path | None = None,
             options: Sequence[str] = ()) -> str:
    """llama-quantize `source` (a converted GGUF) into `target` as `type_name` (Q4_K_M, Q4_0,
    Q8_0, ...), with its `options` (--imatrix FILE, --tensor-type NAME=TYPE, ...); returns
    its output (which lists each tensor's chosen type)."""
    binary = binary or llama_quantize()
    result = subprocess.run([str(binary), "--allow-requantize", *options, source, target,
                             type_name], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"llama-quantize failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout + result.stderr

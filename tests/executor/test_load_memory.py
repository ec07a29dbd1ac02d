"""Memory: loading memory-maps the checkpoint (peak RSS under twice the final weight size),
the default KV cache is sized from what the engine can use, and a one-shot generation of the
bundled model stays well under 1 GB."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.executor.kernels.ops import kernels_available
from pagoda.executor.kv_cache_allocation import CPU_KV_CACHE_DEFAULT_BYTES, determine_num_blocks
from pagoda.executor.model_runner import ModelRunner

MEASURE = r"""
import json, torch
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint

def status_bytes(key):
    # VmHWM is this process image's own peak; ru_maxrss may carry the parent's across exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

checkpoint = open_checkpoint(resolve_model_files(None))
before = status_bytes("VmRSS")
model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=2048)
peak = status_bytes("VmHWM")
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "weights": weights}))
"""


@pytest.mark.slow
def test_peak_rss_during_load_is_under_twice_the_weights() -> None:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    growth = numbers["peak"] - numbers["before"]
    assert growth < 2 * numbers["weights"], numbers


LOAD_ADDS = r"""
import gc, json, os, sys, torch
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint, weight_formats

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

files = resolve_model_files(sys.argv[1] if len(sys.argv) > 1 else None)
open_checkpoint(files)  # the first opening imports what reading any config needs
gc.collect()
before = rss()
checkpoint = open_checkpoint(files)
model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=2048,
                   quantization="auto")
del checkpoint  # the reader's mapping of the file goes with it
gc.collect()
print(json.dumps({"added": rss() - before, "file": os.path.getsize(files.path),
                  "formats": weight_formats(model)}))
"""


def load_adds(model_path: str | None = None) -> dict:
    """RSS after loading a model minus before (torch and the libraries a checkpoint's
    config needs imported, no KV cache), in a fresh process: {"added", "file" (bytes),
    "formats"}."""
    result = subprocess.run([sys.executable, "-c", LOAD_ADDS, *filter(None, [model_path])],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loading_the_bundled_gguf_adds_at_most_1_2x_its_file_size() -> None:
    """Its Q4_1 layers, Q8_0 embedding and the tied head stay packed as the file holds them
    (no float copy of any of them): what the load adds is about the file itself."""
    numbers = load_adds()
    assert numbers["formats"] == "packed q4/q8", numbers
    assert numbers["added"] <= 1.2 * numbers["file"], numbers


ONE_SHOT = r"""
import sys
from pagoda.cli.main import main
code = main(["generate", "--max-tokens", "16", "The capital of France is"])
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print("PEAK", peak, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.slow
def test_one_shot_generate_of_the_bundled_model_stays_well_under_1_gb() -> None:
    """`pagoda generate` with every default (auto dtype and quantization, default KV cache)
    peaked at 4.4 GB when the cache took a share of free RAM and was touched whole at start,
    the GGUF reader kept the tokenizer's arrays and quantization came after a whole float
    model."""
    result = subprocess.run([sys.executable, "-c", ONE_SHOT], capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no text generated"
    peak = int(result.stderr.split("PEAK")[-1].split()[0])
    # measured ~800 MiB on the AVX2 EPYC (float32, 4-bit weights only); bf16 kernel CPUs also
    # keep each layer's bf16 weight for large batches (+~270 MB), not measured this session
    limit = 1200 if kernels_available(torch.bfloat16) else 900
    assert peak < limit * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"


def runner_shape(dtype: torch.dtype, kv_cache_memory: int | None = None) -> ModelRunner:
    """A ModelRunner with the bundled model's KV geometry and no model (what
    determine_num_blocks reads): 30 layers, 3 KV heads of 64."""
    runner = object.__new__(ModelRunner)
    runner.cache_config = CacheConfig(kv_cache_memory=kv_cache_memory)
    runner.device, runner.dtype, runner.block_size = torch.device("cpu"), dtype, 16
    runner.num_layers, runner.num_kv_heads, runner.head_dim = 30, 3, 64
    runner.kv_cache_dtype, runner.kv_planes = "auto", 2
    return runner


def test_default_cpu_kv_cache_is_sized_from_what_the_engine_can_use() -> None:
    bytes_per_block = 16 * 2 * 30 * 3 * 64 * 4  # float32
    many = SchedulerConfig(max_num_seqs=128)
    runner = runner_shape(torch.float32)
    assert determine_num_blocks(runner, 2048, many) == CPU_KV_CACHE_DEFAULT_BYTES // bytes_per_block
    # never more than the engine could fill: 2 sequences x 64 tokens
    assert determine_num_blocks(runner, 64, SchedulerConfig(max_num_seqs=2)) == 8
    # one sequence of max_model_len always fits, even past the default
    assert determine_num_blocks(runner, 20_000, many) == 20_000 // 16  # 0.9 GB, under a fifth of RAM
    # --kv-cache-memory overrides
    assert determine_num_blocks(runner_shape(torch.float32, 1 << 30), 8192, many) == \
        (1 << 30) // bytes_per_block

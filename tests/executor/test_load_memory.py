"""Loading memory-maps the checkpoint: peak RSS stays under twice the final weight size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

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


def test_peak_rss_during_load_is_under_twice_the_weights() -> None:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    growth = numbers["peak"] - numbers["before"]
    assert growth < 2 * numbers["weights"], numbers

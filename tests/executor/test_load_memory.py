"""Loading memory-maps the checkpoint: peak RSS stays under twice the final weight size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MEASURE = r"""
import json, resource, torch
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint

def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

checkpoint = open_checkpoint(resolve_model_files(None))
before = rss_bytes()
model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_position=2048)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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

"""`pagoda bench serve` against a real `pagoda serve` process with the bundled model."""

from __future__ import annotations

import json

import httpx
import pytest

from pagoda.cli.main import main
from tests.entrypoints.server_helpers import SHARED_API_KEY

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metric_total(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"pagoda:{name}_total{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def pagoda_server(shared_server) -> str:
    """The session's shared `pagoda serve` (tests/conftest.py): its URL."""
    return shared_server.url


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_pagoda_serve(pagoda_server, endpoint, tmp_path, capsys):
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    generated_before = metric_total(pagoda_server, "generation_tokens")
    prompt_before = metric_total(pagoda_server, "prompt_tokens")
    rc = main(["bench", "serve", "--base-url", pagoda_server, "--api-key", SHARED_API_KEY,
               "--endpoint", endpoint,
               "--num-requests", "8", "--input-len", "24", "--output-len", "16",
               "--max-concurrency", "4", "--num-warmups", "0", "--no-progress",
               "--slo", "ttft=60s,tpot=10s", "--output", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    records, summary = run["requests"], run["summary"]
    assert result["config"]["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(records) == 8 and summary["completed"] == 8 and summary["failed"] == 0
    for r in records:
        assert r["success"], r["error"]
        assert r["output_tokens"] == 16 and r["finish_reason"] == "length"  # ignore_eos
        assert r["ttft"] > 0 and r["tpot"] > 0 and r["latency"] > r["ttft"]
        assert 1 <= len(r["itl"]) <= 15  # at most one gap per token after the first
        if endpoint == "completions":
            assert r["prompt_tokens"] == 24  # random prompts of exactly --input-len tokens
    # the client's token counts (the server's usage) agree with the server's own counters
    assert summary["total_output_tokens"] == 8 * 16
    assert metric_total(pagoda_server, "generation_tokens") - generated_before == 8 * 16
    assert metric_total(pagoda_server, "prompt_tokens") - prompt_before == \
        summary["total_input_tokens"]
    assert summary["num_good"] == 8
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "Successful requests:" in capsys.readouterr().out

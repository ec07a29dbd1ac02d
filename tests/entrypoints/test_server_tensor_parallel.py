"""`pagoda serve --tensor-parallel-size 2`: a streamed chat answer from two worker
processes equals the single-process server's offline output, and SIGTERM stops the server
and both workers (no process outlives it)."""

from __future__ import annotations

import json

import httpx
import pytest

from pagoda import SamplingParams
from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer
from tests.process_tree import descendant_pids, is_alive

pytestmark = pytest.mark.slow

WORKER = b"pagoda.executor.parallel.worker_process"


def test_tensor_parallel_server_streams_and_stops_cleanly(bundled_llm) -> None:
    prompt = "Write a haiku about the sea."
    expected = bundled_llm.generate(
        prompt, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0].text
    server = RemoteServer(["--tensor-parallel-size", "2"])
    try:
        workers = descendant_pids(server.proc.pid, WORKER)
        assert len(workers) == 2
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "stream": True}) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    finally:
        code = server.stop()
    assert code == 0
    assert not [pid for pid in workers if is_alive(pid)]  # (an orphan would leave the tree)
    assert "Traceback" not in server.log_text()

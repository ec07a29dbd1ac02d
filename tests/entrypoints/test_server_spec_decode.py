"""`pagoda serve --speculative-config`: streamed and whole answers agree token for token
(a step may emit several tokens: the stream carries them as one delta), and /metrics
carries the spec-decode counters that `pagoda bench` reads."""

from __future__ import annotations

import json

import httpx
import pytest

from pagoda.bench.server_metrics import parse_spec_decode_counters, spec_decode_figures
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # (make test-fast skips it)

PROMPT = ("The bridge over the river was built of grey stone in the year of the great flood. "
          "The bridge over the river was built of grey stone")
def _counters(server: RemoteServer):
    return parse_spec_decode_counters(httpx.get(server.url + "/metrics", timeout=10).text)


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'


def test_speculative_server_streams_and_counts():
    with RemoteServer(["--speculative-config", NGRAM, "--served-model-name", "m"]) as server:
        before = _counters(server)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert "choices" in whole, whole
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={**body, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == whole["choices"][0]["text"]
        assert whole["usage"]["completion_tokens"] == 40
        figures = spec_decode_figures(before, _counters(server))
        assert figures is not None and figures["num_accepted_tokens"] > 0
        assert 1.0 < figures["mean_accepted_length"] <= 5.0
        assert "speculative decoding: ngram" in server.log_text()

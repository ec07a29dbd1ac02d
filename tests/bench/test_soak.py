"""`pagoda bench soak` (issue 19, item 2), the short version: a mixed load (completions, chat,
responses, embeddings, forced tool calls and JSON schemas, streams and not, n > 1, stops, logprobs, disconnects and cancels, long and short prompts) on
a server whose KV cache is too small for it, so that requests are preempted. Every greedy
choice equals its reference, every request ends cleanly, nothing stays held or tracked, RSS
does not grow after the warm-up. The long version is benchmarks/soak.sh."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda.bench.soak import SoakReport, embedding_inputs, greedy_templates, soak_workload
from pagoda.bench.soak_shapes import SHAPES, shape_problem
from tests.entrypoints.server_helpers import RemoteServer
from tests.entrypoints.test_cli import assert_one_line_error, run_cli

# About 1,100 tokens of KV cache: two long prompts at once already preempt.
SMALL_CACHE = ["--max-model-len", "1024", "--kv-cache-memory", str(52 * 10**6),
               "--no-access-log"]


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_leaks_nothing(tmp_path) -> None:
    report_path, plot_path = tmp_path / "soak.json", tmp_path / "rss.png"
    with RemoteServer(SMALL_CACHE) as server:
        run = subprocess.run(
            [sys.executable, "-m", "pagoda", "bench", "soak", "--base-url", server.url,
             "--num-requests", "80", "--max-concurrency", "8", "--sample-every", "1",
             "--output", str(report_path), "--plot", str(plot_path)],
            check=False, capture_output=True, text=True, timeout=900,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "Traceback" not in server.log_text()
    report = json.loads(report_path.read_text())
    assert report["problems"] == []
    assert report["outcomes"]["done"] + report["outcomes"].get("aborted", 0) \
        + report["outcomes"].get("error", 0) == 80
    assert report["outcomes"]["aborted"] > 0  # disconnects and cancels happened
    assert report["num_preemptions"] > 0  # the cache was too small, as meant
    assert report["num_greedy_checked"] >= 30 and report["greedy_mismatches"] == []
    assert report["num_embeddings_checked"] >= 3 and report["embedding_mismatches"] == []
    assert report["num_shaped_checked"] >= 3 and report["shape_mismatches"] == []
    assert report["after_drain"]["num_kv_blocks_held"] == 0
    # Growth is the leak; RSS may shrink after the warm-up (the allocator returns memory).
    assert len(report["rss_samples"]) >= 5 and report["rss_after_warmup"] > 0
    assert report["rss_growth"] < 0.05
    assert plot_path.stat().st_size > 10_000


def test_the_workload_mixes_what_it_promises() -> None:
    templates = greedy_templates(seed=3)
    workload = soak_workload(400, 3, templates)
    assert workload == soak_workload(400, 3, templates)  # seeded
    assert {r.endpoint for r in workload} == {"completions", "chat", "responses", "embeddings"}
    responses = [r for r in workload if r.endpoint == "responses"]
    assert all(r.n == 1 and r.stop is None and not r.logprobs for r in responses)
    assert {True, False} <= {r.stream for r in responses}
    assert any(r.template is not None for r in responses)  # checked against chat's reference
    embeddings = [r for r in workload if r.endpoint == "embeddings"]
    assert 0.05 < len(embeddings) / len(workload) < 0.2
    assert {r.fate for r in embeddings} == {"complete", "cancel"}
    assert {r.prompt for r in embeddings} == set(embedding_inputs(3))
    assert all(r.payload() == {"input": r.prompt} for r in embeddings)
    assert "embeddings" not in {r.endpoint for r in soak_workload(400, 3, templates, False)}
    assert {r.fate for r in workload} == {"complete", "disconnect", "cancel"}
    assert all(r.stream for r in workload if r.fate == "disconnect")
    assert {True, False} <= {r.stream for r in workload}
    assert max(r.n for r in workload) > 1 and any(r.logprobs for r in workload)
    assert any(r.stop for r in workload) and any(len(r.prompt) > 1000 for r in workload)
    shaped = [r for r in workload if r.shape is not None]
    assert {r.shape for r in shaped} == set(SHAPES) and 0.05 < len(shaped) / len(workload) < 0.4
    assert all(r.endpoint == "chat" and not r.stream and r.stop is None and r.template is None
               for r in shaped)
    assert all("tools" in r.payload() or "response_format" in r.payload() for r in shaped)
    greedy = [r for r in workload if r.template is not None]
    workload = [r for r in workload if r.endpoint != "embeddings"]
    assert 0.3 < len(greedy) / len(workload) < 0.7
    assert all(r.temperature == 0 for r in greedy)
    assert all(r.seed is not None and r.temperature > 0 for r in workload if r.template is None)


def test_each_check_can_fail() -> None:
    clean = SoakReport(10, outcomes={"done": 10}, rss_after_warmup=100.0, rss_after_drain=104.0,
                       after_drain={"num_kv_blocks_held": 0.0})
    assert clean.problems() == []
    assert SoakReport(10, outcomes={"done": 9, "hung": 1}).problems() == ["1 request(s) hung"]
    assert SoakReport(10, outcomes={"broken": 2}).problems() == ["2 request(s) broken"]
    leaked = SoakReport(10, after_drain={"num_kv_blocks_held": 3.0})
    assert leaked.problems() == ["num_kv_blocks_held is 3 after the drain"]
    grown = SoakReport(10, rss_after_warmup=100.0, rss_after_drain=106.0)
    assert grown.problems() == ["RSS grew 6.0% after the warm-up (limit 5%)"]
    differs = SoakReport(10, greedy_mismatches=[{"request": 1}])
    assert differs.problems() == ["1 greedy choice(s) differ from their reference"]
    moved = SoakReport(10, embedding_mismatches=[{"request": 2, "cosine": 0.5}])
    assert moved.problems() == ["1 embedding(s) differ from their reference"]
    misshaped = SoakReport(10, shape_mismatches=[{"request": 3, "problem": "two calls"}])
    assert misshaped.problems() == ["1 tool-call or JSON answer(s) broke their shape"]


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def test_a_shaped_answer_is_checked_against_its_shape() -> None:
    one = {"message": {"content": None, "tool_calls": [_call("get_weather", '{"city": "Oslo"}')]},
           "finish_reason": "tool_calls"}
    assert shape_problem("tool", one) is None
    two = {**one, "message": {"content": None, "tool_calls": one["message"]["tool_calls"] * 2}}
    assert "not one call" in shape_problem("tool", two)
    wrong = {**one, "message": {"tool_calls": [_call("get_weather", '{"town": 1}')]}}
    assert "schema" in shape_problem("tool", wrong)
    assert shape_problem("tool", {"message": {"content": None}, "finish_reason": "length"}) is None
    leaked = {"message": {"content": "<"}, "finish_reason": "length"}
    assert shape_problem("tool", leaked) == "a cut call leaked content"
    assert "not one call" in shape_problem("tool", {"message": {"content": "hi"},
                                                    "finish_reason": "stop"})
    good = {"message": {"content": '{"answer": "yes"}'}, "finish_reason": "stop"}
    assert shape_problem("json", good) is None
    for bad in ('{"answer": 1}', '{"answer": "a", "b": 2}', '{"answer": "a"'):
        assert "schema" in shape_problem("json", {"message": {"content": bad},
                                                  "finish_reason": "stop"})
    assert shape_problem("json", {"message": {"content": '{"ans'}, "finish_reason": "length"}) \
        is None


def test_bad_soak_flags_are_one_line_errors() -> None:
    result = run_cli("bench", "soak", "--num-requests", "0")
    assert_one_line_error(result, "--num-requests must be positive")
    result = run_cli("bench", "soak", "--warmup-fraction", "1.5")
    assert_one_line_error(result, "--warmup-fraction must be in (0, 1)")


def test_a_malformed_answer_counts_as_broken_not_a_crash() -> None:
    import asyncio

    import httpx

    from pagoda.bench.soak import SoakRequest, run_request

    def answer(request: httpx.Request) -> httpx.Response:
        if b'"stream": true' in request.content or b'"stream":true' in request.content:
            return httpx.Response(200, text="data: {not json\n\n")
        return httpx.Response(200, json={"no": "choices"})

    async def main():
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport) as client:
            return [await run_request(client, "http://test", SoakRequest(
                index=i, endpoint="completions", prompt="Hi", max_tokens=4, stream=stream),
                None, 10.0) for i, stream in enumerate((False, True))]

    outcomes = asyncio.run(main())
    assert [o.status for o in outcomes] == ["broken", "broken"]
    assert "KeyError" in outcomes[0].detail and "JSONDecodeError" in outcomes[1].detail


def test_responses_requests_are_read_whole_and_streamed() -> None:
    """The soak's reading of /v1/responses answers, against the server in-process (the fake
    engine of test_serving_pipeline.py answers `a` per token): the text, whole and streamed,
    a disconnect, and a failure as a clean error."""
    import asyncio

    import httpx

    from pagoda.bench.soak import SoakRequest, run_request
    from pagoda.entrypoints.openai.model_registry import ServedModel
    from pagoda.entrypoints.openai.server import build_app
    from pagoda.entrypoints.openai.server_state import ServerState
    from tests.entrypoints.test_serving_pipeline import FakeAsyncEngine

    engine = FakeAsyncEngine()
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")]))

    async def main(**fields) -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app)) as client:
            return [await run_request(client, "http://test", SoakRequest(
                index=i, endpoint="responses", prompt="Hi", max_tokens=3, stream=stream,
                **fields), None, 10.0) for i, stream in enumerate((False, True))]

    outcomes = asyncio.run(main())
    assert [(o.status, o.texts) for o in outcomes] == [("done", {0: "aaa"})] * 2
    outcome = asyncio.run(main(fate="disconnect"))[1]
    assert outcome.status == "aborted"
    engine.fail_at_step = 2
    outcomes = asyncio.run(main())
    assert [o.status for o in outcomes] == ["error", "error"]
    assert all("engine failed" in o.detail for o in outcomes)

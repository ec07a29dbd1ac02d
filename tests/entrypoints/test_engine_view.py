"""The live engine view's data: request timelines recorded by the engine, the view's JSON
built from snapshots, and the /v1/engine/stream endpoint (rate bound, model resolution)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagoda import SamplingParams
from pagoda.engine.stats.request_timeline import RequestTimeline, RequestTimelines
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.entrypoints.openai.protocol.errors import install_error_handlers
from pagoda.entrypoints.web import routes
from pagoda.entrypoints.web.engine_view import NUM_TIMELINE_REQUESTS, EngineView, percentiles

# ---- request timelines -------------------------------------------------------------------


def test_timelines_keep_the_last_finished_and_the_in_flight_ones() -> None:
    timelines = RequestTimelines(max_finished=3, max_in_flight=4)
    for i in range(6):
        timelines.add(f"r{i}", arrival_time=100.0 + i, num_prompt_tokens=10)
    assert [r.request_id for r in timelines.published] == ["r2", "r3", "r4", "r5"]  # cap 4
    timelines.record_prefill([("r2", 6), ("r3", 10)], start=110.0, end=110.5)
    timelines.record_prefill([("r2", 4)], start=110.5, end=111.0)
    timelines.record_first_tokens(["r2", "r3"], 111.0)
    timelines.record_first_tokens(["r2"], 112.0)  # only the first counts
    timelines.preempted(["r4"])
    r2 = timelines.published[0]
    assert r2.prefill_chunks == ((110.0, 110.5, 6), (110.5, 111.0, 4))
    assert r2.first_scheduled_time == 110.0 and r2.first_token_time == 111.0
    assert timelines.published[2].num_preemptions == 1
    for i, request_id in enumerate(["r2", "r3", "r4", "r5"]):
        timelines.finish(request_id, 120.0 + i, "length", num_output_tokens=11)
    published = timelines.published
    assert [r.request_id for r in published] == ["r3", "r4", "r5"]  # the last 3 finished
    assert published[0].ttft == pytest.approx(111.0 - 103.0)
    assert published[0].tpot == pytest.approx((121.0 - 111.0) / 10)
    assert published[1].ttft is None and published[1].tpot is None  # never got a token
    # nothing changed: the very same tuple is published again (no per-step copy)
    assert timelines.published is published
    timelines.finish("unknown", 130.0, "abort", 0)
    assert timelines.published is published


def test_engine_records_prefill_decode_split_and_timelines(bundled_llm) -> None:
    engine = bundled_llm.engine
    prompt = list(range(100, 140))
    engine.add_request("view-a", prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("view-b", prompt[:25], SamplingParams(max_tokens=3, temperature=0))
    snapshots = []
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(engine.snapshot())
    first = snapshots[0]
    assert first.last_step_num_seqs == 2
    assert first.last_step_num_prefill_tokens == first.last_step_num_tokens > 0
    assert first.last_step_num_decode_tokens == 0
    later = snapshots[1]
    assert later.last_step_num_prefill_tokens == 0
    assert later.last_step_num_decode_tokens == later.last_step_num_seqs == 2
    records = {r.request_id: r for r in snapshots[-1].request_timelines}
    for request_id, num_prompt, max_tokens in [("view-a", 40, 4), ("view-b", 25, 3)]:
        record = records[request_id]
        assert record.num_prompt_tokens == num_prompt
        assert record.finish_reason == "length" and record.num_output_tokens == max_tokens
        assert 1 <= sum(n for _, _, n in record.prefill_chunks) <= num_prompt  # cache hits
        assert (record.arrival_time <= record.first_scheduled_time <= record.first_token_time
                <= record.finish_time)
    # an abort before the first token is recorded as such
    engine.add_request("view-c", prompt, SamplingParams(max_tokens=4))
    queued = {r.request_id: r for r in engine.snapshot().request_timelines}["view-c"]
    assert queued.prefill_chunks == () and queued.finish_time is None
    engine.abort_request("view-c")
    aborted = engine.snapshot().request_timelines[-1]
    assert (aborted.request_id, aborted.finish_reason) == ("view-c", "abort")
    assert not engine.has_unfinished_requests()


# ---- the view's JSON ---------------------------------------------------------------------


def test_percentiles_match_numpy() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.5]
    expected = np.percentile(values, [50, 90, 99])
    result = percentiles(values)
    assert list(result) == ["p50", "p90", "p99"]
    assert list(result.values()) == pytest.approx(list(expected))
    assert percentiles([]) is None
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}


def finished(i: int, now: float) -> RequestTimeline:
    return RequestTimeline(f"r{i}", now - 10 + i * 0.1, 8, ((now - 9, now - 8.5, 8),),
                           first_token_time=now - 8.5 + i * 0.01, finish_time=now - 1,
                           finish_reason="stop", num_output_tokens=11)


def test_view_json_from_snapshots() -> None:
    clock = iter([1000.0, 1000.5])
    view = EngineView("m", clock=lambda: next(clock))
    before = EngineSnapshot(num_generation_tokens=100, num_computed_prompt_tokens=50,
                            num_steps=10, prefix_cache_queries=10, prefix_cache_hits=5)
    first = view.tick(before)
    assert first["interval"] == 0 and first["throughput"]["generation_tokens_per_s"] is None
    records = tuple(finished(i, 1000.5) for i in range(40)) + (
        RequestTimeline("live", 999.0, 8, ((999.2, 999.4, 8),), first_token_time=999.4),
        RequestTimeline("queued", 1000.2, 5),
    )
    after = EngineSnapshot(
        running_request_ids=("live",), waiting_request_ids=("queued", "p"),
        num_preempted_seqs=1, num_kv_blocks=100, num_free_kv_blocks=60,
        num_cached_free_kv_blocks=70,  # (stale, over the free count: clamped)
        kv_block_size=16, kv_cache_usage=0.4, last_step_num_seqs=3, last_step_num_tokens=20,
        last_step_num_prefill_tokens=18, last_step_num_decode_tokens=2,
        num_generation_tokens=150, num_computed_prompt_tokens=70, num_steps=15,
        prefix_cache_queries=30, prefix_cache_hits=10, request_timelines=records,
        finished_by_reason={"stop": 40},
    )
    event = view.tick(after)
    json.dumps(event)  # plain JSON
    assert event["queue"] == {"waiting": 2, "running": 1, "preempted": 1, "waiting_seqs": 0,
                              "running_seqs": 0}
    assert event["batch"] == {"num_seqs": 3, "num_tokens": 20, "num_prefill_tokens": 18,
                              "num_decode_tokens": 2}
    assert event["kv"] == {"num_blocks": 100, "block_size": 16, "used": 40, "cached": 60,
                           "free": 0, "usage": 0.4, "tiers": None}
    assert event["prefix_cache"]["hit_rate"] == pytest.approx(10 / 30)
    assert event["prefix_cache"]["recent_hit_rate"] == pytest.approx(5 / 20)
    assert event["throughput"] == {"generation_tokens_per_s": 100.0,
                                   "prompt_tokens_per_s": 40.0, "steps_per_s": 10.0}
    latency = event["latency"]
    assert latency["num_requests"] == 40
    ttfts = [r.ttft for r in records[:40]]
    assert latency["ttft"]["p90"] == pytest.approx(np.percentile(ttfts, 90))
    assert latency["tpot"]["p50"] == pytest.approx(np.percentile([r.tpot for r in records[:40]],
                                                                 50))
    shown = event["requests"]
    assert len(shown) == NUM_TIMELINE_REQUESTS
    assert [r["state"] for r in shown[-3:]] == ["finished", "decode", "queued"]
    live = shown[-2]
    assert live["arrival"] == pytest.approx(-1.5) and live["first_token"] == pytest.approx(-1.1)
    assert live["chunks"] == [[pytest.approx(-1.3), pytest.approx(-1.1), 8]]
    assert live["finish"] is None and live["finish_reason"] is None


# ---- the endpoint ------------------------------------------------------------------------


def fake_engine(num_steps: int = 0) -> SimpleNamespace:
    return SimpleNamespace(snapshot=EngineSnapshot(num_steps=num_steps), is_alive=True)


def app_with(engines: dict) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    routes.add_web_routes(app, lambda: engines)
    return TestClient(app)


def events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_stream_rate_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(routes, "MAX_STREAM_S", 1.0)
    client = app_with({"m": fake_engine(7)})
    start = time.monotonic()
    with client.stream("GET", "/v1/engine/stream?interval=0.001") as response:  # -> 0.1 s
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = events(response)
    elapsed = time.monotonic() - start
    assert 2 <= len(received) <= 11 and len(received) <= elapsed / routes.MIN_INTERVAL_S + 1
    assert received[0]["model"] == "m" and received[0]["counters"]["num_steps"] == 7
    assert routes.parse_interval("100") == routes.MAX_INTERVAL_S
    assert routes.parse_interval(None) == routes.DEFAULT_INTERVAL_S <= 0.25  # <= 4 a second


def test_stream_model_resolution_and_errors(monkeypatch) -> None:
    monkeypatch.setattr(routes, "MAX_STREAM_S", 0.3)
    engines = {"a": fake_engine(), "b": fake_engine()}
    client = app_with(engines)
    response = client.get("/v1/engine/stream?model=nope")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    response = client.get("/v1/engine/stream")  # two loaded: which?
    assert response.status_code == 400 and "a" in response.json()["error"]["message"]
    response = client.get("/v1/engine/stream?model=a&interval=soon")
    assert response.status_code == 400 and response.json()["error"]["param"] == "interval"
    with client.stream("GET", "/v1/engine/stream?model=b&interval=0.1") as response:
        assert response.status_code == 200
        received = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                received.append(json.loads(line[5:]))
                engines.pop("b", None)  # unloaded while the page watches it
    assert received[0]["model"] == "b"
    assert received[-1]["error"]["code"] == "model_not_found" and len(received) == 2


def test_page_and_assets_are_served() -> None:
    client = app_with({"m": fake_engine()})
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in page.text and "/static/style.css" in page.text
    for asset in ["app.js", "api.js", "chat.js", "engine_view.js", "charts.js", "style.css"]:
        response = client.get(f"/static/{asset}")
        assert response.status_code == 200 and len(response.text) > 500, asset
    # nothing is fetched from outside the server
    for asset in ["index.html", "app.js", "api.js", "chat.js", "engine_view.js", "charts.js",
                  "style.css"]:
        text = (routes.STATIC_DIR / asset).read_text()
        assert "http://" not in text and "https://" not in text, asset


def test_rates_are_over_a_window_of_ticks() -> None:
    clock = iter([0.0, 1.0, 2.0, 3.0])
    view = EngineView("m", clock=lambda: next(clock))
    rates = [view.tick(EngineSnapshot(num_generation_tokens=n))["throughput"]
             ["generation_tokens_per_s"] for n in (0, 10, 20, 60)]
    # at t=3 the window (2 s) reaches back to the tick at t=1
    assert rates == [None, 10.0, 10.0, 25.0]

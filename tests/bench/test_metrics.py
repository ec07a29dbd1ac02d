"""Metric arithmetic on synthetic timestamps: known TTFT, TPOT, ITL, percentiles, goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagoda.bench.metrics import (
    RequestRecord,
    describe,
    meets_slo,
    parse_duration,
    parse_slo,
    summarize,
)
from pagoda.bench.serve import TrafficConfig, arrival_times


def record(index=0, chunk_times=(0.5, 0.6, 0.8, 0.9), latency=1.0, output_tokens=4,
           prompt_tokens=10, success=True) -> RequestRecord:
    return RequestRecord(index=index, success=success, chunk_times=list(chunk_times),
                         latency=latency, output_tokens=output_tokens,
                         prompt_tokens=prompt_tokens)


def test_per_request_ttft_itl_tpot():
    r = record()
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    # (e2e - ttft) / (output_tokens - 1), with the server's token count, not the chunk count
    assert r.tpot == pytest.approx((1.0 - 0.5) / 3)
    r.output_tokens = 6
    assert r.tpot == pytest.approx(0.5 / 5)


def test_one_token_output_has_no_tpot():
    r = record(chunk_times=[0.3], latency=0.31, output_tokens=1)
    assert r.ttft == pytest.approx(0.3)
    assert r.itl == []
    assert r.tpot is None


def test_to_json_holds_the_derived_metrics():
    data = record().to_json()
    assert data["ttft"] == pytest.approx(0.5)
    assert data["tpot"] == pytest.approx(0.5 / 3)
    assert data["itl"] == pytest.approx([0.1, 0.2, 0.1])
    assert "chunk_times" not in data


def test_describe_percentiles_use_linear_interpolation():
    stats = describe(list(range(1, 101)))
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "p90": 90.1, "p95": 95.05,
                                   "p99": 99.01})
    assert describe([]) == dict.fromkeys(["mean", "median", "p90", "p95", "p99"])
    assert describe([7.0])["p99"] == 7.0


def test_summarize_throughput_and_failures():
    records = [
        record(0, chunk_times=[0.2, 0.3], latency=0.4, output_tokens=2, prompt_tokens=10),
        record(1, chunk_times=[0.4, 0.5, 0.7], latency=0.8, output_tokens=3, prompt_tokens=20),
        RequestRecord(index=2, error="HTTP 500: boom", error_kind="http", latency=0.1),
        RequestRecord(index=3, error="dropped", error_kind="dropped", latency=0.3,
                      chunk_times=[0.1], output_tokens=None),
    ]
    s = summarize(records, duration=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors_by_kind"] == {"http": 1, "dropped": 1}
    assert s["total_output_tokens"] == 5 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    # only successful requests enter the latency statistics
    assert s["ttft_s"]["mean"] == pytest.approx(0.3)
    assert s["tpot_s"]["mean"] == pytest.approx(((0.4 - 0.2) / 1 + (0.8 - 0.4) / 2) / 2)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.1 + 0.2) / 3)
    assert s["e2el_s"]["median"] == pytest.approx(0.6)
    assert "goodput" not in s


def test_goodput_counts_requests_within_every_bound():
    slo = parse_slo("ttft=500ms,tpot=50ms")
    fast = record(chunk_times=[0.1, 0.14, 0.18], latency=0.2, output_tokens=3)  # tpot 50 ms
    slow_first = record(chunk_times=[0.6, 0.61], latency=0.62, output_tokens=2)
    slow_decode = record(chunk_times=[0.1, 0.3], latency=0.4, output_tokens=3)  # tpot 150 ms
    failed = record(success=False)
    assert meets_slo(fast, slo)
    assert not meets_slo(slow_first, slo)
    assert not meets_slo(slow_decode, slo)
    assert not meets_slo(failed, slo)
    s = summarize([fast, slow_first, slow_decode, failed], duration=4.0, slo=slo)
    assert s["num_good"] == 1
    assert s["goodput"] == pytest.approx(0.25)
    assert meets_slo(fast, {"itl": 0.041}) and not meets_slo(fast, {"itl": 0.039})
    assert meets_slo(fast, {"e2el": 0.2}) and not meets_slo(fast, {"e2el": 0.19})


def test_parse_slo_and_durations():
    assert parse_slo("ttft=500ms,tpot=50ms") == pytest.approx({"ttft": 0.5, "tpot": 0.05})
    assert parse_slo(" TTFT = 1.5s , e2el=2000 ") == pytest.approx({"ttft": 1.5, "e2el": 2.0})
    assert parse_duration("50") == pytest.approx(0.05)  # a bare number is milliseconds
    for bad in ["", "ttft", "ttft=fast", "latency=5ms", "ttft=-5ms", "ttft=0"]:
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_arrivals_poisson_and_bursty():
    assert arrival_times(5, TrafficConfig()) == [0.0] * 5
    times = arrival_times(20000, TrafficConfig(request_rate=4.0, seed=1))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # gamma with shape k: coefficient of variation 1/sqrt(k); Poisson (k=1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    bursty = np.diff(arrival_times(20000, TrafficConfig(request_rate=4.0, burstiness=0.25,
                                                        seed=1)))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert arrival_times(10, TrafficConfig(request_rate=2.0, seed=3)) == \
        arrival_times(10, TrafficConfig(request_rate=2.0, seed=3))
    for bad in [{"request_rate": 0.0}, {"request_rate": -1.0}, {"burstiness": 0.0},
                {"burstiness": math.inf}, {"max_concurrency": 0}]:
        with pytest.raises(ValueError):
            TrafficConfig(**bad)

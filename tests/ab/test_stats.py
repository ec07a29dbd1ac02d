"""The A/B statistics: the bootstrap's coverage on samples with a known difference, and
analyze()/verdict() on synthetic results with known winners, ties, errors, goodput and cost."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagoda.ab.stats import analyze, bootstrap_ratio_ci, verdict
from pagoda.bench import BenchError
from tests.ab.synthetic import drifting_blocks_run, lognormal_run, request, result


def _row(analysis: dict, metric: str, statistic: str, comparison: int = 0) -> dict:
    return next(r for r in analysis["comparisons"][comparison]["metrics"]
                if r["metric"] == metric and r["statistic"] == statistic)


@pytest.mark.parametrize("paired", [False, True])
def test_bootstrap_covers_a_known_difference_about_95_percent_of_the_time(paired):
    # B's true median is 20% below A's; the samples are lognormal (sd 0.6 in log space).
    # Paired: b_i shares a_i's request size (correlation 0.8), same marginal spread.
    rng = np.random.default_rng(1234)
    trials, n, truth, covered = 200, 150, -0.2, 0
    for _ in range(trials):
        z = rng.normal(size=n)
        a = np.exp(0.6 * z)
        w = 0.8 * z + 0.6 * rng.normal(size=n) if paired else rng.normal(size=n)
        b = 0.8 * np.exp(0.6 * w)
        _, low, high = bootstrap_ratio_ci(a, b, "median", paired=paired, resamples=400, rng=rng)
        covered += low <= truth <= high
    assert 0.90 <= covered / trials <= 0.99


def test_bootstrap_ratio_ci_point_and_degenerate_inputs():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    point, low, high = bootstrap_ratio_ci(a, a * 1.5, "mean", paired=True, resamples=200)
    assert point == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)
    assert bootstrap_ratio_ci([1.0], [2.0, 3.0], "p95", paired=False) == (None, None, None)
    assert bootstrap_ratio_ci([0.0, 0.0], [2.0, 3.0], "mean", paired=False) == (None, None, None)
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_ratio_ci(a, a, "p200", paired=True)


def test_a_clearly_better_candidate_is_chosen_with_an_interval_excluding_zero():
    analysis = analyze(lognormal_run(n=200, ttft_factor={"B": 0.6}, seed=1), resamples=500)
    comparison = analysis["comparisons"][0]
    row = _row(analysis, "ttft", "p95")
    assert row["high"] < 0 and row["excludes_zero"] and row["significant"]
    assert row["favours"] == "B"
    assert comparison["outcome"] == "better" and analysis["choice"] == "B"
    assert "choose B" in analysis["verdict"] and "P95 TTFT" in analysis["verdict"]
    assert "lower (95% CI" in analysis["verdict"]
    # TPOT does not differ: it must not be listed as a difference
    assert not _row(analysis, "tpot", "median")["significant"]


def test_identical_distributions_give_no_difference_and_an_estimate_of_requests_needed():
    analysis = analyze(lognormal_run(n=150, seed=2), resamples=500)
    comparison = analysis["comparisons"][0]
    assert comparison["outcome"] == "no_difference" and analysis["choice"] is None
    row = _row(analysis, "ttft", "p95")
    assert row["low"] < 0 < row["high"]
    assert not any(r["significant"] for r in comparison["metrics"])
    more = comparison["more_requests"]
    assert isinstance(more, int) and more > 0
    assert "no difference within the noise" in analysis["verdict"]
    assert f"run about {more} more requests" in analysis["verdict"]
    # the estimate follows 1/sqrt(n): the widest half-width narrowed to 5%
    widest = next(r for r in comparison["metrics"] if r["name"] == comparison["widest_metric"])
    half = (widest["high"] - widest["low"]) / 2
    expected = comparison["num_compared"] * (half / 0.05) ** 2 - comparison["num_compared"]
    assert more == pytest.approx(expected, rel=0.1)


def test_pairing_by_key_narrows_the_interval_when_requests_vary_a_lot():
    # Request sizes vary wildly (log sd 1.0) but B = 0.9 x A per request, up to 2% noise.
    factors = {"B": 0.9}
    paired = analyze(lognormal_run(n=200, ttft_factor=factors, sigma=1.0, same_requests=True,
                                   noise=0.02, seed=3), resamples=500)
    unpaired = analyze(lognormal_run(n=200, ttft_factor=factors, sigma=1.0, same_requests=True,
                                     noise=0.02, seed=3, key_offset={"B": 10_000}),
                       resamples=500)
    assert paired["comparisons"][0]["paired"] and paired["comparisons"][0]["num_pairs"] == 200
    assert not unpaired["comparisons"][0]["paired"]
    p, u = _row(paired, "ttft", "median"), _row(unpaired, "ttft", "median")
    assert p["low"] <= -0.1 <= p["high"]
    assert (p["high"] - p["low"]) * 5 < u["high"] - u["low"]
    assert p["significant"] and not u["significant"]


def test_repeats_pair_run_by_run_and_unkeyed_requests_stay_unpaired():
    requests = [request(name, key, 0.1 * (1 + key) * (0.5 if name == "B" else 1.0),
                        repeat=repeat)
                for name in ("A", "B") for key in range(8) for repeat in range(2)]
    requests += [request("A", None, 0.3), request("B", None, 0.2)]
    analysis = analyze(result(requests), resamples=200)
    comparison = analysis["comparisons"][0]
    assert comparison["paired"] and comparison["num_pairs"] == 16
    assert _row(analysis, "ttft", "mean")["num_baseline"] == 16


def test_errors_are_counted_and_said_first():
    requests = [request(name, i, 0.2 + 0.001 * i) for name in ("A", "B") for i in range(200)]
    for i in range(10):  # B fails 6 by HTTP and 4 by timeout, and is otherwise faster
        requests[200 + i] = request("B", i, None, success=False,
                                    error_kind="http" if i < 6 else "timeout")
    for r in requests[210:]:
        r["ttft"] *= 0.5
        r["latency"] -= r["ttft"]
    analysis = analyze(result(requests), resamples=500)
    a, b = analysis["endpoints"]
    assert (a["failed"], b["failed"]) == (0, 10)
    assert b["errors_by_kind"] == {"http": 6, "timeout": 4}
    assert b["success_rate"] == pytest.approx(190 / 200)
    errors = analysis["comparisons"][0]["error_rate"]
    assert errors["candidate_rate"] == pytest.approx(0.05) and errors["worse"] == "B"
    assert errors["low"] > 0
    text = analysis["verdict"]
    assert text.index("B fails more requests") < text.index("TTFT")
    assert analysis["comparisons"][0]["outcome"] == "mixed" and analysis["choice"] is None
    assert "fix them before choosing it" in text


def test_goodput_and_cost_on_a_hand_checked_example():
    # A: TTFTs 0.1 0.2 0.6 0.3 s -> 3 of 4 within ttft<=500ms in 10 s = 0.3 req/s;
    #    40 output tokens, 3.6/hour for 10 s = 0.01 -> 250 per million tokens.
    # B: all 4 within the SLO in 10 s = 0.4 req/s; 7.2/hour -> 500 per million tokens.
    requests = ([request("A", i, t, output_tokens=10) for i, t in enumerate([0.1, 0.2, 0.6, 0.3])]
                + [request("B", i, 0.1, output_tokens=10) for i in range(4)])
    analysis = analyze(result(requests, durations={"A": 10.0, "B": 10.0},
                              costs={"A": 3.6, "B": 7.2}),
                       slo={"ttft": 0.5}, resamples=200)
    a, b = analysis["endpoints"]
    assert (a["num_good"], b["num_good"]) == (3, 4)
    assert a["goodput"] == pytest.approx(0.3) and b["goodput"] == pytest.approx(0.4)
    assert a["output_throughput"] == pytest.approx(4.0)
    assert a["cost_per_million_output_tokens"] == pytest.approx(250.0)
    assert b["cost_per_million_output_tokens"] == pytest.approx(500.0)
    comparison = analysis["comparisons"][0]
    assert comparison["cost_per_million_output_tokens_ratio"] == pytest.approx(2.0)
    assert comparison["output_throughput_ratio"] == pytest.approx(1.0)
    goodput = _row(analysis, "goodput", "rate")
    assert goodput["difference"] == pytest.approx(0.4 / 0.3 - 1)
    assert goodput["higher_is_better"] and goodput["decisive"]
    assert not comparison["paired"]  # 4 pairs: too few to pair
    assert analysis["slo_s"] == {"ttft": 0.5}


def test_greedy_output_agreement_counts_equal_texts_of_greedy_pairs():
    requests = [request("A", i, 0.1, output_text=f"text {i}") for i in range(12)]
    for i in range(12):
        text = f"other {i}" if i in (3, 7) else f"text {i}"
        requests.append(request("B", i, 0.1, output_text=text, greedy=i != 11))
    agreement = analyze(result(requests), resamples=200)["comparisons"][0]["output_agreement"]
    assert agreement["pairs"] == 11 and agreement["equal"] == 9
    assert agreement["share"] == pytest.approx(9 / 11)
    assert agreement["differing_keys"] == [3, 7]


def test_mixed_results_say_who_is_faster_at_what_and_tie_breaks_decide_where_they_can():
    # B: TTFT halved, TPOT 25% slower; with 20-token outputs E2E comes out about even
    run = lognormal_run(n=300, ttft_factor={"B": 0.5}, tpot_factor={"B": 1.25}, seed=4)
    analysis = analyze(run, resamples=500)
    assert analysis["comparisons"][0]["outcome"] == "mixed" and analysis["choice"] is None
    assert "B faster to first token" in analysis["verdict"]
    assert "A faster per output token" in analysis["verdict"]
    # with an SLO on TTFT, goodput decides
    slo_analysis = analyze(run, slo={"ttft": 0.2}, resamples=500)
    comparison = slo_analysis["comparisons"][0]
    assert (comparison["outcome"], comparison["decided_by"]) == ("better", "goodput")
    assert "choose B (goodput at the SLO decides" in slo_analysis["verdict"]
    # TPOT only 10% slower: B finishes requests sooner, and end-to-end latency decides
    run = lognormal_run(n=300, ttft_factor={"B": 0.5}, tpot_factor={"B": 1.1}, seed=4)
    comparison = analyze(run, resamples=500)["comparisons"][0]
    assert (comparison["outcome"], comparison["decided_by"]) == ("better", "e2el")
    assert _row_of(comparison, "tpot", "median")["favours"] == "A"


def _row_of(comparison: dict, metric: str, statistic: str) -> dict:
    return next(r for r in comparison["metrics"]
                if r["metric"] == metric and r["statistic"] == statistic)


def test_three_endpoints_each_against_the_first():
    run = lognormal_run(n=200, ttft_factor={"B": 0.6}, names=("A", "B", "C"), seed=5)
    analysis = analyze(run, resamples=500)
    outcomes = [(c["candidate"], c["baseline"], c["outcome"]) for c in analysis["comparisons"]]
    assert outcomes == [("B", "A", "better"), ("C", "A", "no_difference")]
    assert analysis["choice"] == "B" and analysis["verdict"].endswith("Choose B.")


def test_the_analysis_is_json_and_deterministic_and_its_verdict_survives_a_round_trip():
    run = lognormal_run(n=100, ttft_factor={"B": 0.8}, seed=6)
    first = analyze(run, slo={"ttft": 0.3, "tpot": 0.05}, resamples=300, seed=9)
    text = json.dumps(first, allow_nan=False)
    assert json.loads(text) == first
    assert verdict(json.loads(text)) == first["verdict"]
    assert analyze(run, slo={"ttft": 0.3, "tpot": 0.05}, resamples=300, seed=9) == first
    assert set(first) == {"baseline", "confidence", "resamples", "seed", "slo_s", "rules",
                          "endpoints", "comparisons", "choice", "verdict",
                          "calibration"}


def test_bad_results_are_named():
    with pytest.raises(BenchError, match="no endpoints"):
        analyze({"requests": []})
    with pytest.raises(BenchError, match="endpoint 'Z' is not one of A, B"):
        analyze(result([request("Z", 0, 0.1)]))
    with pytest.raises(BenchError, match="no requests for endpoint 'B'"):
        analyze(result([request("A", 0, 0.1)]))
    failed = request("B", 0, None, success=False, error_kind="dropped")
    failed["latency"] = None
    with pytest.raises(BenchError, match="no duration for endpoint 'B'"):
        analyze(result([request("A", 0, 0.1), failed], durations={"A": 1.0}))
    with pytest.raises(BenchError, match="confidence"):
        analyze(result([]), confidence=1.5)


def test_one_endpoint_has_nothing_to_compare():
    analysis = analyze(result([request("A", 0, 0.1)], names=("A",)), resamples=200)
    assert analysis["comparisons"] == [] and "nothing to compare" in analysis["verdict"]


def test_blocks_are_drawn_whole_so_a_drifting_machine_does_not_fake_a_difference():
    """Identical endpoints on a machine whose speed drifts between block passes: drawing
    requests one by one calls them different far more often than 5% of the time; drawing
    whole blocks (what a replay records) keeps the false calls rare."""
    trials, false_by_block, false_by_request = 40, 0, 0
    for seed in range(trials):
        for blocked in (True, False):
            analysis = analyze(drifting_blocks_run(12, 16, drift=0.08, seed=seed,
                                                   blocked=blocked), resamples=300, seed=seed)
            comparison = analysis["comparisons"][0]
            assert comparison["resampled"] == ("blocks" if blocked else "requests")
            called = comparison["outcome"] != "no_difference"
            if blocked:
                false_by_block += called
            else:
                false_by_request += called
    assert false_by_block / trials <= 0.15
    assert false_by_request / trials >= 0.5


def test_too_few_blocks_give_no_interval_and_say_how_to_get_one():
    analysis = analyze(drifting_blocks_run(3, 16, drift=0.0, seed=0), resamples=300)
    comparison = analysis["comparisons"][0]
    assert comparison["too_few_blocks"] and comparison["num_blocks"] == 3
    ttft = _row(analysis, "ttft", "median")
    assert ttft["difference"] is not None and ttft["low"] is None and not ttft["significant"]
    assert comparison["outcome"] == "no_difference"
    assert "only 3 blocks" in analysis["verdict"] and "--repeats" in analysis["verdict"]


def test_outputs_are_compared_only_where_the_histories_match():
    """A later turn that carried each endpoint's own replies may differ without either
    engine being wrong: it is left out of the agreement."""
    requests = []
    for key in range(12):
        live = key >= 8  # four later turns
        for name in ("A", "B"):
            row = request(name, key, 0.2, output_text=f"{name}{key}" if live else "same")
            row["live_history"] = live
            requests.append(row)
    agreement = analyze(result(requests), resamples=200)["comparisons"][0]["output_agreement"]
    assert agreement["pairs"] == 8 and agreement["share"] == 1.0

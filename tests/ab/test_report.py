"""The A/B report: the HTML page is self-contained (inline SVG, nothing fetched), carries the
verdict and escapes every string from the result; the terminal summary ends with the verdict."""

from __future__ import annotations

import html
import re

from pagoda.ab.report import format_text, render_html
from pagoda.ab.stats import analyze
from pagoda.bench.svg_chart import nice_ticks
from tests.ab.synthetic import lognormal_run, request


def _run_with_traps() -> dict:
    run = lognormal_run(n=60, ttft_factor={"B": 0.6}, seed=7)
    run["endpoints"][1]["label"] = "<script>alert(1)</script>"
    run["endpoints"][0]["hardware"] = {"cpu": "<b>bold</b>", "kernels": ["avx2"]}
    run["endpoints"][0]["cost_per_hour"] = 2.5
    run["requests"].append(request("B", 999, None, success=False, error_kind="http"))
    run["requests"][-1]["error"] = 'HTTP 500: <img src="http://evil.example/x.png">'
    run["config"] = {"note": "</pre><script>bad()</script>"}
    return run


def test_the_page_has_the_verdict_the_tables_and_an_svg_per_chart():
    run = _run_with_traps()
    analysis = analyze(run, slo={"ttft": 0.25}, resamples=300)
    page = render_html(run, analysis)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert html.escape(analysis["verdict"]) in page
    assert page.count("<svg") == 4  # CDFs of TTFT, TPOT, E2E and TTFT over the run
    for title in ("TTFT CDF", "TPOT CDF", "E2E latency CDF", "TTFT over the run"):
        assert title in page
    assert page.count("<polyline") == 6 and page.count("<circle") > 100
    for section in ("Requests, throughput and cost", "TTFT", "TPOT", "ITL", "E2E latency",
                    "Errors"):
        assert f"<h2>{section}</h2>" in page
    assert "B vs A (95% CI)" in page and "goodput req/s" in page


def test_the_page_escapes_the_results_strings_and_loads_nothing():
    run = _run_with_traps()
    page = render_html(run, analyze(run, resamples=300))
    assert "<script" not in page.lower() and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=&quot;http://evil.example/x.png&quot;&gt;" in page
    assert not re.search(r"<[^>]*\b(src|href)\s*=", page)  # no resource, no link in a tag
    urls = {e["url"] for e in run["endpoints"]} | {"http://evil.example/x.png"}
    found = set(re.findall(r"https?://[^\s\"'<>&]+", page))
    assert found <= urls, found - urls  # only the endpoints' URLs and the error's text


def test_the_terminal_summary_ends_with_the_verdict():
    run = _run_with_traps()
    analysis = analyze(run, resamples=300)
    text = format_text(run, analysis)
    assert "| metric" in text and "| P95 ms" in text and "B vs A (95% CI)" in text
    verdict_part = text[text.index("Verdict: "):]
    assert " ".join(verdict_part.split()) == "Verdict: " + analysis["verdict"]
    assert "http 1" in text  # the failure, by kind


def test_an_endpoint_without_successes_draws_an_empty_chart():
    run = lognormal_run(n=20, seed=8)
    run["requests"] = [r for r in run["requests"] if r["endpoint"] == "A"] + [
        request("B", i, None, success=False, error_kind="timeout") for i in range(20)]
    analysis = analyze(run, resamples=200)
    page = render_html(run, analysis)
    assert page.count("<svg") == 4 and "B fails more requests" in analysis["verdict"]


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 730) == [0, 200, 400, 600]
    assert nice_ticks(5, 5) == [5]

"""Spec-decode acceptance from a server's /metrics: the figures of two hand-written scrapes
(pagoda: and vllm: names), nothing for a server without the counters, and `pagoda bench
serve` reporting them (or running without them)."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import report
from pagoda.bench.server_metrics import (
    SpecDecodeCounters,
    parse_spec_decode_counters,
    spec_decode_figures,
)
from tests.bench.test_serve_fake import run_bench, write_jsonl
from tests.helpers.fake_server import FakeServer

PAGODA_BEFORE = """\
# HELP pagoda:prompt_tokens_total Prompt tokens processed.
# TYPE pagoda:prompt_tokens_total counter
pagoda:prompt_tokens_total{model_name="m"} 5000.0
# HELP pagoda:spec_decode_num_drafts Drafts proposed.
# TYPE pagoda:spec_decode_num_drafts counter
pagoda:spec_decode_num_drafts_total{model_name="m"} 100.0
# TYPE pagoda:spec_decode_num_draft_tokens counter
pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 300.0
# TYPE pagoda:spec_decode_num_accepted_tokens counter
pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 150.0
# TYPE pagoda:spec_decode_num_accepted_tokens_per_pos counter
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 80.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 50.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 20.0
"""

# 40 drafts of 3 tokens, 90 accepted: 35 at position 0, 32 at 1, 23 at 2.
PAGODA_AFTER = """\
# TYPE pagoda:prompt_tokens_total counter
pagoda:prompt_tokens_total{model_name="m"} 9000.0
# TYPE pagoda:spec_decode_num_drafts counter
pagoda:spec_decode_num_drafts_total{model_name="m"} 140.0
# TYPE pagoda:spec_decode_num_draft_tokens counter
pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 420.0
# TYPE pagoda:spec_decode_num_accepted_tokens counter
pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 240.0
# TYPE pagoda:spec_decode_num_accepted_tokens_per_pos counter
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 43.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 115.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 82.0
"""

PAGODA_FIGURES = {
    "num_drafts": 40, "num_draft_tokens": 120, "num_accepted_tokens": 90,
    "acceptance_rate": 0.75, "mean_accepted_length": 3.25,
    "acceptance_per_position": [35 / 40, 32 / 40, 23 / 40],
}


def assert_figures(actual: dict | None, expected: dict) -> None:
    assert actual is not None and actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value), key


def vllm_text(engines: list[tuple[int, int, int, list[int]]]) -> str:
    """vLLM's layout: one label set per engine, `_created` samples, HELP lines."""
    lines = []
    for name, column in (("num_drafts", 0), ("num_draft_tokens", 1),
                         ("num_accepted_tokens", 2)):
        lines += [f"# HELP vllm:spec_decode_{name}_total Spec decode {name}.",
                  f"# TYPE vllm:spec_decode_{name}_total counter"]
        for e, values in enumerate(engines):
            labels = f'engine="{e}",model_name="m"'
            lines += [f"vllm:spec_decode_{name}_total{{{labels}}} {float(values[column])}",
                      f"vllm:spec_decode_{name}_created{{{labels}}} 1.7e+09"]
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    for e, values in enumerate(engines):
        for position, count in enumerate(values[3]):
            lines.append("vllm:spec_decode_num_accepted_tokens_per_pos_total"
                         f'{{engine="{e}",model_name="m",position="{position}"}} {float(count)}')
    return "\n".join(lines) + "\n"


VLLM_BEFORE = vllm_text([(10, 40, 20, [8, 6, 4, 2]), (10, 40, 10, [6, 3, 1, 0])])
# engine 0: +20 drafts, +80 tokens, +50 accepted (15, 13, 11, 11);
# engine 1: +10 drafts, +40 tokens, +20 accepted (7, 6, 4, 3).
VLLM_AFTER = vllm_text([(30, 120, 70, [23, 19, 15, 13]), (20, 80, 30, [13, 9, 5, 3])])


def test_pagoda_counters_are_parsed_and_differenced():
    before = parse_spec_decode_counters(PAGODA_BEFORE)
    assert before == SpecDecodeCounters(100.0, 300.0, 150.0, (80.0, 50.0, 20.0))
    figures = spec_decode_figures(before, parse_spec_decode_counters(PAGODA_AFTER))
    assert_figures(figures, PAGODA_FIGURES)


def test_a_data_parallel_servers_replica_copies_are_not_counted_again():
    lines = PAGODA_BEFORE.splitlines()
    copies = [line.replace('model_name="m"', f'model_name="m",replica="{r}"')
              for r in (0, 1) for line in lines if line.startswith("pagoda:spec")]
    text = "\n".join(lines + copies) + "\n"
    assert parse_spec_decode_counters(text) == parse_spec_decode_counters(PAGODA_BEFORE)


def test_vllm_counters_are_summed_over_label_sets():
    after = parse_spec_decode_counters(VLLM_AFTER)
    assert after == SpecDecodeCounters(50.0, 200.0, 100.0, (36.0, 28.0, 20.0, 16.0))
    figures = spec_decode_figures(parse_spec_decode_counters(VLLM_BEFORE), after)
    assert_figures(figures, {
        "num_drafts": 30, "num_draft_tokens": 120, "num_accepted_tokens": 70,
        "acceptance_rate": 70 / 120, "mean_accepted_length": 1 + 70 / 30,
        "acceptance_per_position": [22 / 30, 19 / 30, 15 / 30, 14 / 30],
    })
    assert isinstance(figures["num_drafts"], int)


def test_the_pagoda_names_win_over_vllm_aliases():
    # A server that exposes both names counts each draft once.
    both = parse_spec_decode_counters(PAGODA_BEFORE + VLLM_AFTER)
    assert both == parse_spec_decode_counters(PAGODA_BEFORE)


@pytest.mark.parametrize("text", [
    "",
    "# TYPE pagoda:prompt_tokens_total counter\npagoda:prompt_tokens_total{model_name=\"m\"} 7\n",
    "<html><body>404 Not Found</body></html>",
    "{\"detail\": \"Not Found\"}",
])
def test_text_without_the_counters_yields_nothing(text):
    assert parse_spec_decode_counters(text) is None
    assert spec_decode_figures(parse_spec_decode_counters(text),
                               parse_spec_decode_counters(PAGODA_AFTER)) is None


def test_no_drafts_or_a_restarted_server_yields_nothing():
    before = parse_spec_decode_counters(PAGODA_BEFORE)
    after = parse_spec_decode_counters(PAGODA_AFTER)
    assert spec_decode_figures(after, after) is None  # no drafts made in between
    assert spec_decode_figures(after, before) is None  # counters went down
    assert spec_decode_figures(before, None) is None


def test_positions_new_in_the_second_scrape_count_from_zero():
    before = SpecDecodeCounters(10.0, 20.0, 5.0, ())
    after = SpecDecodeCounters(20.0, 40.0, 15.0, (6.0, 4.0))
    figures = spec_decode_figures(before, after)
    assert figures["acceptance_per_position"] == pytest.approx([0.6, 0.4])
    assert figures["mean_accepted_length"] == pytest.approx(2.0)


def test_bench_without_metrics_endpoint_reports_no_spec_decode(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    out = tmp_path / "r.json"
    with FakeServer() as server:  # no /metrics: GET answers 404
        assert run_bench("--base-url", server.url, "--dataset", dataset, "--num-requests", "3",
                         "--output-len", "3", "--output", str(out)) == 0
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 3 and "spec_decode" not in summary
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed
    assert "Spec decode" not in printed and "Mean accepted length" not in printed


def test_bench_reports_acceptance_between_scrapes(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    out = tmp_path / "r.json"
    # Run 1 sees BEFORE then AFTER; run 2 sees AFTER twice: no drafts, no figures.
    with FakeServer(metrics_texts=[PAGODA_BEFORE, PAGODA_AFTER]) as server:
        assert run_bench("--base-url", server.url, "--dataset", dataset, "--num-requests", "4",
                         "--output-len", "3", "--max-concurrency", "1,2",
                         "--output", str(out)) == 0
        # two per run, and one (after the first run's) for the server's cost per hour
        assert server.app.state.metrics_scrapes == 5
    result = json.loads(out.read_text())
    first, second = (run["summary"] for run in result["runs"])
    assert_figures(first["spec_decode"], PAGODA_FIGURES)
    assert first["completed"] == 4 and "spec_decode" not in second
    printed = capsys.readouterr().out
    assert printed.count("Spec decode acceptance rate:") == 1 and "75.0%" in printed
    assert printed.count("Mean accepted length:") == 1 and "3.25" in printed
    assert "accepted len" in printed  # the sweep table's column
    table = report.compare_table([("spec", result)])
    assert "mean accepted length" in table and "3.25" in table

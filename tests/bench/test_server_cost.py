"""`pagoda bench serve`'s cost: --cost-per-hour, or the server's pagoda:cost_per_hour, turns
the run's wall time and token counts into cost per million input and output tokens
(pagoda/bench/server_cost.py, pagoda/cost.py)."""

from __future__ import annotations

import json

import pytest

from pagoda.bench.server_cost import parse_cost_per_hour
from pagoda.cli.main import main
from pagoda.cost import cost_figures
from tests.bench.test_serve_fake import run_bench, write_jsonl
from tests.helpers.fake_server import FakeServer
from tests.helpers.ports import free_port

SERVER_PAGE = """\
# TYPE pagoda:cost_per_hour gauge
pagoda:cost_per_hour 7.2
# TYPE pagoda:prompt_tokens_total counter
pagoda:prompt_tokens_total{model_name="m"} 10.0
"""


def test_the_arithmetic():
    figures = cost_figures(3.6, 10.0, input_tokens=4000, output_tokens=1000)
    assert figures["cost_usd"] == pytest.approx(0.01)  # 3.6 USD/h for 10 s
    assert figures["per_million_input_tokens"] == pytest.approx(2.5)
    assert figures["per_million_output_tokens"] == pytest.approx(10.0)
    assert figures["per_million_tokens"] == pytest.approx(2.0)
    assert cost_figures(3.6, 10.0, 0, 0)["per_million_input_tokens"] is None
    assert parse_cost_per_hour(SERVER_PAGE) == 7.2
    assert parse_cost_per_hour("pagoda:prompt_tokens_total 1\n") is None
    assert parse_cost_per_hour("not { prometheus") is None


def run(tmp_path, *args: str, metrics_texts=None) -> dict:
    """The summary of a 3-request run against the fake server."""
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    out = tmp_path / "r.json"
    with FakeServer(metrics_texts=metrics_texts) as server:
        assert run_bench("--base-url", server.url, "--dataset", dataset, "--num-requests", "3",
                         "--output-len", "4", "--output", str(out), *args) == 0
    return json.loads(out.read_text())["runs"][0]["summary"]


def check_cost(summary: dict, cost_per_hour: float, source: str) -> None:
    cost = summary["cost"]
    assert cost["source"] == source and cost["cost_per_hour"] == cost_per_hour
    assert cost["cost_usd"] == pytest.approx(cost_per_hour * summary["duration_s"] / 3600)
    assert cost["per_million_output_tokens"] == pytest.approx(
        cost["cost_usd"] / summary["total_output_tokens"] * 1e6)
    assert cost["per_million_input_tokens"] == pytest.approx(
        cost["cost_usd"] / summary["total_input_tokens"] * 1e6)


def test_the_flag_prices_the_run(tmp_path, capsys):
    summary = run(tmp_path, "--cost-per-hour", "3.6")
    assert summary["total_output_tokens"] == 12
    check_cost(summary, 3.6, "flag")
    printed = capsys.readouterr().out
    assert "Cost per hour (USD, flag):" in printed
    assert "Cost per million input tokens (USD):" in printed
    assert "Cost per million output tokens (USD):" in printed


def test_bench_compare_shows_the_cost_rows():
    from pagoda.bench import report

    cheap = {"kind": "serve", "runs": [{"request_rate": "inf", "max_concurrency": None,
                                         "summary": {"cost": {"per_million_input_tokens": 1.0,
                                                              "per_million_output_tokens": 4.0}}}]}
    dear = {"kind": "serve", "runs": [{"request_rate": "inf", "max_concurrency": None,
                                        "summary": {"cost": {"per_million_input_tokens": 2.0,
                                                             "per_million_output_tokens": 6.0}}}]}
    table = report.compare_table([("cheap", cheap), ("dear", dear)])
    assert "| USD per 1M input tokens  | 1.0000 | 2.0000 (×2.00) |" in table
    assert "| USD per 1M output tokens | 4.0000 | 6.0000 (×1.50) |" in table


def test_without_the_flag_the_servers_own_price_is_used(tmp_path, capsys):
    summary = run(tmp_path, metrics_texts=[SERVER_PAGE])
    check_cost(summary, 7.2, "server")
    assert "Cost per hour (USD, server):" in capsys.readouterr().out


def test_no_price_no_cost(tmp_path, capsys):
    summary = run(tmp_path)  # the fake server has no /metrics
    assert "cost" not in summary
    assert "Cost per" not in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_price_is_one_line_and_exit_2(value, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}",
               "--cost-per-hour", value])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "--cost-per-hour must be a finite number" in err, err

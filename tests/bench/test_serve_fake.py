"""`pagoda bench serve` against a fake OpenAI-compatible server: failures of every kind are
counted and reported, never dropped; traffic shaping; JSON and PNG; CLI errors exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda.cli.main import main
from tests.helpers.fake_server import MODEL, FakeServer
from tests.helpers.ports import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, entries) -> str:
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return str(path)


def run_bench(*args: str) -> int:
    return main(["bench", "serve", "--no-progress", "--num-warmups", "0", *args])


def test_failed_requests_are_counted_and_the_run_finishes(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "ok one"}, {"prompt": "ok two"}, {"prompt": "ok three"},
        {"prompt": "please [[500]]"},
        {"prompt": "please [[drop]]"},
        {"prompt": "please [[nodone]]"},
        {"prompt": "please [[error]]"},
        {"prompt": "please [[hang]]"},
        {"conversations": [{"from": "human", "value": "first [[500]]"},
                           {"from": "gpt", "value": "never"},
                           {"from": "human", "value": "second turn"}]},
    ])
    out = tmp_path / "result.json"
    with FakeServer() as server:
        rc = run_bench("--base-url", server.url, "--dataset", dataset, "--num-requests", "10",
                       "--num-turns", "2", "--output-len", "4", "--timeout", "2",
                       "--output", str(out))
        num_sent = len(server.requests)
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "serve" and result["config"]["model"] == MODEL
    run = result["runs"][0]
    records, summary = run["requests"], run["summary"]
    assert len(records) == 10 and sorted(r["index"] for r in records) == list(range(10))
    assert num_sent == 9  # the turn after a failed turn is not sent, but it is recorded
    assert summary["completed"] == 3 and summary["failed"] == 7
    assert summary["errors_by_kind"] == {"http": 2, "dropped": 1, "protocol": 2, "timeout": 1,
                                         "skipped": 1}
    for r in records:
        if r["success"]:
            assert r["output_tokens"] == 4 and r["error"] is None
            assert len(r["itl"]) == 3 and r["ttft"] is not None and r["tpot"] is not None
        else:
            assert r["error"] and r["error_kind"]
    by_kind = {r["error_kind"]: r for r in records if not r["success"]}
    assert by_kind["http"]["http_status"] == 500 and "boom" in by_kind["http"]["error"]
    assert by_kind["skipped"]["turn"] == 1
    assert summary["total_output_tokens"] == 12
    printed = capsys.readouterr().out
    assert "Failed requests:" in printed and "[http] HTTP 500: boom" in printed


def test_chat_sweep_slo_json_and_plot(tmp_path):
    dataset = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"prompt": f"question {i}"} for i in range(4)])
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    with FakeServer(delay=0.01) as server:
        rc = run_bench("--base-url", server.url + "/v1", "--endpoint", "chat",
                       "--dataset", dataset, "--num-requests", "4", "--output-len", "5",
                       "--request-rate", "50,inf", "--slo", "ttft=10s,tpot=5s",
                       "--output", str(out), "--plot", str(png))
        bodies = list(server.requests)
    assert rc == 0
    assert len(bodies) == 8 and all(b["messages"][-1]["role"] == "user" for b in bodies)
    assert all(b["ignore_eos"] and b["min_tokens"] == 5 and b["temperature"] == 0.0
               for b in bodies)
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == [50.0, "inf"]
    for run in result["runs"]:
        s = run["summary"]
        assert s["completed"] == 4 and s["total_output_tokens"] == 20
        assert s["num_good"] == 4 and s["goodput"] == pytest.approx(4 / s["duration_s"])
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_max_concurrency_bounds_requests_in_flight(tmp_path):
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    with FakeServer(delay=0.02) as server:
        assert run_bench("--base-url", server.url, "--dataset", dataset, "--num-requests", "6",
                         "--output-len", "5", "--max-concurrency", "2") == 0
        assert server.app.state.max_in_flight == 2


@pytest.mark.parametrize("args, message", [
    (["--slo", "ttft=fast"], "--slo"),
    (["--slo", "speed=5ms"], "--slo"),
    (["--request-rate", "abc"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "1,2", "--max-concurrency", "1,2"], "not both"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset", "/no/such/file.jsonl"], "no such file"),
    (["--base-url", "ftp://x"], "--base-url"),
    ([], "cannot reach"),
])
def test_cli_errors_print_one_line_and_exit_2(args, message, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and message in err, err


def test_cli_error_exit_code_of_the_process():
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda", "bench", "serve", "--slo", "nope"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--slo" in proc.stderr


def test_each_run_of_a_sweep_gets_fresh_prompts(tmp_path):
    # Repeated prompts would be served from the prefix cache of the previous run.
    out = tmp_path / "r.json"
    with FakeServer() as server:
        assert run_bench("--base-url", server.url, "--num-requests", "3", "--input-len", "8",
                         "--output-len", "2", "--max-concurrency", "1,2",
                         "--output", str(out)) == 0
        prompts = [b["prompt"] for b in server.requests]
    assert len(prompts) == 6 and len(set(prompts)) == 6
    runs = json.loads(out.read_text())["runs"]
    assert [r["workload_seed"] for r in runs] == [0, 1]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    assert all(r["summary"]["completed"] == 3 for r in runs)

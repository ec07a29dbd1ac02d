"""`pagoda bench ab` end to end on real servers: traffic captured by `pagoda serve
--record-traffic`, replayed to servers that differ in a way with a known winner, and to two
identical servers; the verdict, the intervals, the JSON and the HTML report."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from pagoda.cli.main import main
from tests.entrypoints.server_helpers import RemoteServer

# No prefix cache: a request replayed to a server that saw it before must not get a cheaper
# prefill than on the other server.
SERVER_ARGS = ["--no-prefix-caching"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(one sequence at a time and recording, 16 at a time, another 16 at a time, the
    recorded traffic file). The two batched servers are configured alike, recording
    included: the serial one records, so that no difference between them is real."""
    folder = tmp_path_factory.mktemp("ab")
    recording, traffic = folder / "recording.jsonl", folder / "traffic.jsonl"
    with RemoteServer([*SERVER_ARGS, "--max-num-seqs", "1", "--record-traffic",
                       str(recording)]) as serial, \
            RemoteServer([*SERVER_ARGS, "--max-num-seqs", "16"]) as batched, \
            RemoteServer([*SERVER_ARGS, "--max-num-seqs", "16"]) as twin:
        # Capture: 32 concurrent greedy requests, recorded by the serial server. The batched
        # twins get the same load, so that both have run batches of every size once
        # (first-time costs of a shape: allocations, kernel set-up) before the comparison.
        for server in (serial, batched, twin):
            rc = main(["bench", "serve", "--base-url", server.url, "--no-progress",
                       "--num-warmups", "0", "--num-requests", "32", "--input-len", "48",
                       "--output-len", "12", "--max-concurrency", "16"])
            assert rc == 0
            if server is serial:  # the capture, before the replays add to the recording
                wait_for_lines(recording, 32)  # written by the recorder's thread
                shutil.copy(recording, traffic)
        yield serial, batched, twin, str(traffic)


def wait_for_lines(path, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} has fewer than {count} lines after {timeout} s")


def run_ab(tmp_path, *args: str) -> dict:
    out = tmp_path / "ab.json"
    # 32 requests in blocks of 8, each block sent at once, twice: 8 blocks per endpoint,
    # drawn whole
    rc = main(["bench", "ab", "--no-progress", "--num-warmups", "1", "--block-size", "8",
               "--request-rate", "inf", "--repeats", "2", "--resamples", "1000",
               "--output", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_verdict_picks_the_server_that_batches(servers, tmp_path, capsys):
    serial, batched, _, traffic = servers
    with open(traffic) as f:
        recorded = [json.loads(line) for line in f]
    assert len(recorded) == 32 and all(r["output_tokens"] == 12 for r in recorded)
    html = tmp_path / "ab.html"
    result = run_ab(tmp_path, "--endpoint", f"serial={serial.url}",
                    "--endpoint", f"batched={batched.url}", "--traffic", traffic,
                    "--cost", "serial=1.0", "--cost", "batched=1.0", "--slo", "ttft=2s",
                    "--html", str(html),
                    # the verdict's own rules: both report the same hardware, so calibration
                    # would be on by default, and its floor is measured from this run's
                    # passes; test_identical_servers_are_called_the_same covers it
                    "--calibrate", "off")
    text = capsys.readouterr().out
    analysis = result["analysis"]
    assert len(result["requests"]) == 128 and all(r["success"] for r in result["requests"])
    [comparison] = analysis["comparisons"]
    assert comparison["baseline"] == "serial" and comparison["candidate"] == "batched"
    assert comparison["paired"] and comparison["num_pairs"] == 64
    assert comparison["resampled"] == "blocks" and comparison["num_blocks"] == 8
    assert comparison["winner"] == "batched" and analysis["choice"] == "batched"
    # 8 requests in flight: one at a time queues them, so the batched server's time to first
    # token is lower, with an interval that excludes zero. By how much depends on the CPU
    # (on how cheap a decode step is beside a prefill; the interval's bound was -20 % on a
    # Zen 4 EPYC), so only the direction is asserted, with the significance the verdict
    # rests on.
    ttft = next(m for m in comparison["metrics"] if m["metric"] == "ttft" and
                m["statistic"] == "p95")
    assert ttft["excludes_zero"] and ttft["high"] < 0 and ttft["significant"]
    assert comparison["output_throughput_ratio"] > 1.0
    # same price per hour, more tokens per second: a lower cost per token
    assert comparison["cost_per_million_output_tokens_ratio"] < 1.0
    # greedy requests, same model and dtype: the same text on both
    assert comparison["output_agreement"]["share"] == 1.0
    # what each endpoint runs on, from its GET /version
    for endpoint in result["endpoints"]:
        assert endpoint["hardware"]["engine"].startswith("pagoda")
        assert endpoint["hardware"]["dtype"] == "float32"
    assert "choose batched" in analysis["verdict"]
    assert " ".join(analysis["verdict"].split()) in " ".join(text.split())  # printed, wrapped
    page = html.read_text()
    assert analysis["verdict"].split(":")[0] in page and page.count("<svg") >= 3


@pytest.mark.slow
def test_identical_servers_are_called_the_same(servers, tmp_path):
    """Two processes of one configuration differ by a few percent on some CPUs (start
    order, warm-up, memory layout: measured on a Zen 4 EPYC, BENCHMARKS.md), which the
    fixed 2% bar called a winner about half the time. Both report the same hardware, so the
    A/A noise floor is measured from each one's own two passes and no difference under it
    is called (pagoda/ab/calibration.py)."""
    _, batched, twin, traffic = servers
    result = run_ab(tmp_path, "--endpoint", f"one={batched.url}", "--endpoint",
                    f"two={twin.url}", "--traffic", traffic)
    analysis = result["analysis"]
    calibration = analysis["calibration"]
    assert calibration["requested"] and calibration["method"] == "repeats"
    assert set(calibration["by_endpoint"]) == {"one", "two"}
    [comparison] = analysis["comparisons"]
    assert comparison["outcome"] == "no_difference" and analysis["choice"] is None
    decisive = [m for m in comparison["metrics"] if m["decisive"]]
    assert decisive and not any(m["significant"] for m in decisive)
    # every decisive interval includes zero, or its difference is under the bar: the
    # larger of 2% and the A/A floor
    for m in decisive:
        assert m["min_difference"] == max(0.02, calibration["floor"])
        assert (m["family_low"] <= 0 <= m["family_high"]
                or abs(m["difference"]) < m["min_difference"])
    assert "no difference" in analysis["verdict"].lower()
    assert "A/A noise floor" in analysis["verdict"]


@pytest.mark.parametrize("args, message", [
    (["--endpoint", "A=http://127.0.0.1:9"], "at least two --endpoint"),
    (["--endpoint", "A=http://x", "--endpoint", "A=http://y"], "given twice"),
    (["--endpoint", "A", "--endpoint", "B=http://y"], "NAME=VALUE"),
    (["--endpoint", "A=ftp://x", "--endpoint", "B=http://y", "--traffic", "{traffic}"],
     "http://"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y"], "--traffic FILE is needed"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "/no/such"],
     "no such file"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "{traffic}",
      "--cost", "C=1"], "no --endpoint is named 'C'"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "{traffic}",
      "--cost", "A=cheap"], "not a number"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "{traffic}",
      "--block-size", "0"], "--block-size"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "{traffic}",
      "--slo", "ttft=fast"], "duration"),
    (["--endpoint", "A=http://127.0.0.1:9", "--endpoint", "B=http://127.0.0.1:9",
      "--traffic", "{traffic}"], "--endpoint A: cannot reach"),
    (["--from-record", "{traffic}", "--endpoint", "A=http://x"], "--from-record"),
    (["--endpoint", "A=http://x", "--endpoint", "B=http://y", "--traffic", "{traffic}",
      "--confidence", "1.5"], "--confidence"),
])
def test_bad_flags_exit_2_with_a_message(tmp_path, capsys, args, message):
    traffic = tmp_path / "t.jsonl"
    traffic.write_text(json.dumps({"arrival": 0.0, "endpoint": "completions",
                                   "body": {"prompt": "hi", "max_tokens": 2}}) + "\n")
    args = [a.replace("{traffic}", str(traffic)) for a in args]
    assert main(["bench", "ab", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

"""`pagoda ab-proxy` between fake OpenAI-compatible servers (tests/helpers/fake_server.py): the
user gets the primary's bytes as they come, whatever the candidate does (slow, failing, killed
under load and restarted); mirror and split reach the candidate as promised; the record reads
back as an A/B result; bad flags exit 2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.responses import JSONResponse

from pagoda.ab import proxy_upstream
from pagoda.ab.proxy import ABProxy
from pagoda.ab.proxy_config import ProxyConfig
from pagoda.ab.proxy_record import RecordWriter, read_proxy_record
from pagoda.ab.proxy_upstream import Upstream, UpstreamError
from pagoda.bench import BenchError
from pagoda.cli.main import main
from tests.helpers.fake_server import FakeServer
from tests.helpers.fake_server import FakeServerProcess as FakeProcess
from tests.helpers.ports import free_port

ROOT = Path(__file__).parents[2]
DONE = b"data: [DONE]\n\n"


class ProxyServer:
    """ABProxy under uvicorn in a thread."""

    def __init__(self, **config) -> None:
        self.proxy = ABProxy(ProxyConfig(**config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.proxy, host="127.0.0.1", port=port, log_level="critical", lifespan="on",
            server_header=False, date_header=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ProxyServer:  # noqa: PYI034
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "proxy did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def wait_for_shadows(self, timeout: float = 20) -> dict:
        deadline = time.time() + timeout
        while self.proxy.stats.shadows_in_flight and time.time() < deadline:
            time.sleep(0.02)
        assert self.proxy.stats.shadows_in_flight == 0
        return self.proxy.stats_json()


def completion(prompt: str, max_tokens: int = 6, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **extra}


async def _post_many(url: str, bodies: list[dict], path: str) -> list[tuple[int, bytes, float]]:
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(body: dict) -> tuple[int, bytes, float]:
            t0 = time.perf_counter()
            async with client.stream("POST", url + path, json=body) as response:
                data = await response.aread()
            return response.status_code, data, time.perf_counter() - t0
        return await asyncio.gather(*(one(body) for body in bodies))


def post_many(url: str, bodies: list[dict], path: str = "/v1/completions"):
    """(status, body bytes, seconds) of each request, all sent at once."""
    return asyncio.run(_post_many(url, bodies, path))


def record_lines(path: Path) -> list[dict]:
    return [line for line in map(json.loads, path.read_text().splitlines())
            if "endpoint" in line]


def test_the_user_gets_the_primarys_bytes_as_they_come_and_the_candidate_a_copy(tmp_path):
    record = tmp_path / "ab.jsonl"
    with FakeServer(delay=0.05) as primary, FakeServer() as candidate, ProxyServer(
            primary=primary.url, candidate=candidate.url, mirror=True,
            record_path=str(record)) as proxy:
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                "stream": True, "temperature": 0.7}
        cases = [("POST", "/v1/completions", completion("one two")),
                 ("POST", "/v1/chat/completions", chat),
                 ("POST", "/v1/completions", completion("[[500]]")),
                 ("GET", "/v1/models", None), ("GET", "/nope?x=1", None)]
        for method, path, body in cases:
            direct = httpx.request(method, primary.url + path, json=body)
            relayed = httpx.request(method, proxy.url + path, json=body)
            assert relayed.status_code == direct.status_code, path
            assert relayed.content == direct.content, path
            assert relayed.headers.get("content-type") == direct.headers.get("content-type")
        # chunks are relayed as they come: 5 tokens 50 ms apart arrive spread out
        arrivals, t0 = [], time.perf_counter()
        with httpx.stream("POST", proxy.url + "/v1/completions",
                          json=completion("spread", max_tokens=5)) as response:
            for _ in response.iter_raw():
                arrivals.append(time.perf_counter() - t0)
        assert arrivals[0] < 0.15 and arrivals[-1] - arrivals[0] > 0.15, arrivals
        stats = proxy.wait_for_shadows()

    generation = [json.dumps(body, sort_keys=True) for _, path, body in cases if path.startswith(
        "/v1/c")] + [json.dumps(completion("spread", max_tokens=5), sort_keys=True)]
    assert sorted(json.dumps(b, sort_keys=True) for b in candidate.requests) == sorted(generation)
    assert stats["shadows_sent"] == 4 and stats["shadows_failed"] == 1  # the [[500]]
    assert stats["requests_forwarded"] == 6 and stats["generation_requests"] == 4
    lines = record_lines(record)
    assert len(lines) == 8
    by_key: dict[int, dict[str, dict]] = {}
    for line in lines:
        by_key.setdefault(line["key"], {})[line["endpoint"]] = line
    assert all(set(sides) == {"primary", "candidate"} for sides in by_key.values())
    first = by_key[min(by_key)]
    for side in ("primary", "candidate"):
        assert first[side]["success"] and first[side]["output_tokens"] == 6
        assert first[side]["output_text"] == " w0 w1 w2 w3 w4 w5" and first[side]["greedy"]
        assert first[side]["ttft"] is not None and len(first[side]["itl"]) == 5
    assert first["primary"]["latency"] > 0.2 > first["candidate"]["latency"]  # 50 ms delays
    chat_line = [s for s in by_key.values() if s["primary"]["path"].endswith("chat/completions")]
    assert chat_line[0]["primary"]["output_text"] is None  # not greedy: no text kept
    failed = [s for s in by_key.values() if not s["primary"]["success"]]
    assert [s["candidate"]["error_kind"] for s in failed] == ["http"]
    assert failed[0]["primary"]["http_status"] == 500

    result = read_proxy_record(str(record))
    assert [e["name"] for e in result["endpoints"]] == ["primary", "candidate"]
    assert result["endpoints"][0]["url"] == primary.url
    assert len(result["requests"]) == 8 and set(result["duration"]) == {"primary", "candidate"}
    assert result["duration"]["primary"] > 0.2


def test_a_slow_candidate_never_slows_the_user_and_shadows_stay_bounded(tmp_path):
    record = tmp_path / "ab.jsonl"
    with FakeServer(delay=0.01) as primary, FakeServer(delay=0.25) as candidate, ProxyServer(
            primary=primary.url, candidate=candidate.url, mirror=True, record_path=str(record),
            candidate_timeout=1.0, max_shadow_in_flight=4) as proxy:
        results = post_many(proxy.url, [completion(f"user {i}", 8) for i in range(16)])
        stats = proxy.wait_for_shadows()
    assert all(status == 200 and data.endswith(DONE) for status, data, _ in results)
    assert max(seconds for *_, seconds in results) < 1.0  # a shadow takes 1.75 s
    assert (stats["shadows_sent"], stats["shadows_dropped"], stats["shadows_failed"]) == (4, 12, 0)
    shadows = [line for line in record_lines(record) if line["endpoint"] == "candidate"]
    assert sorted(line["error_kind"] or "ok" for line in shadows) == ["ok"] * 4 + ["shed"] * 12
    assert min(line["latency"] for line in shadows if line["success"]) > 1.7


def test_a_candidate_silent_past_its_timeout_is_recorded_as_timing_out(tmp_path):
    record = tmp_path / "ab.jsonl"
    silent = FakeServer()

    @silent.app.middleware("http")
    async def no_headers_for_a_while(request, call_next):
        await asyncio.sleep(3)
        return await call_next(request)

    with FakeServer() as primary, silent, ProxyServer(
            primary=primary.url, candidate=silent.url, mirror=True, record_path=str(record),
            candidate_timeout=1.0) as proxy:
        results = post_many(proxy.url, [completion(f"user {i}", 4) for i in range(4)])
        stats = proxy.wait_for_shadows()
    assert all(status == 200 and data.endswith(DONE) and seconds < 0.8
               for status, data, seconds in results)
    assert stats["shadows_failed"] == 4
    assert {line["error_kind"] for line in record_lines(record)
            if line["endpoint"] == "candidate"} == {"timeout"}


def test_a_user_who_leaves_mid_stream_frees_the_primary(tmp_path):
    record = tmp_path / "ab.jsonl"
    with FakeServer(delay=0.2) as primary, FakeServer() as candidate, ProxyServer(
            primary=primary.url, candidate=candidate.url, mirror=True,
            record_path=str(record)) as proxy:
        with httpx.stream("POST", proxy.url + "/v1/completions",
                          json=completion("long", max_tokens=50)) as response:
            next(response.iter_raw())
        deadline = time.time() + 5  # the proxy sees it at the next chunk, 0.2 s later
        while primary.app.state.in_flight and time.time() < deadline:
            time.sleep(0.05)
        assert primary.app.state.in_flight == 0
        proxy.wait_for_shadows()
    sides = {line["endpoint"]: line for line in record_lines(record)}
    assert sides["primary"]["error_kind"] == "cancelled" and sides["candidate"]["success"]


@pytest.mark.slow
def test_the_candidate_killed_under_load_then_restarted(tmp_path):
    record = tmp_path / "ab.jsonl"
    # The candidate streams 5x slower than the primary (1.5 s against 0.3 s), so a user kept
    # waiting on it shows in the order of the record's ends, whatever the machine's load.
    candidate = FakeProcess(free_port(), delay=0.1)
    candidate.start()
    try:
        with FakeServer(delay=0.02) as primary, ProxyServer(
                primary=primary.url, candidate=candidate.url, mirror=True,
                record_path=str(record), candidate_timeout=5) as proxy:
            bodies = [completion(f"user {i}", 16) for i in range(16)]
            expected = [httpx.post(primary.url + "/v1/completions", json=b).content
                        for b in bodies]

            def check(results) -> None:
                assert [(s, data) for s, data, _ in results] == [(200, e) for e in expected]
                # the candidate's timeout is 5 s: waiting on a dead one anywhere would show here
                assert max(seconds for *_, seconds in results) < 2.5, results

            check(post_many(proxy.url, bodies))  # 1: both up (keys 0-15)
            assert proxy.wait_for_shadows()["shadows_failed"] == 0
            killer = threading.Timer(0.12, candidate.kill)
            killer.start()
            check(post_many(proxy.url, bodies))  # 2: the candidate dies mid-stream
            killer.join()
            check(post_many(proxy.url, bodies))  # 3: the candidate is gone (keys 32-47)
            failed_while_down = proxy.wait_for_shadows()["shadows_failed"]
            assert failed_while_down >= 16
            candidate.start()
            check(post_many(proxy.url, bodies))  # 4: back on the same port (keys 48-63)
            stats = proxy.wait_for_shadows()
            assert stats["shadows_failed"] == failed_while_down
            assert stats["shadows_sent"] == 64 and stats["shadows_dropped"] == 0
    finally:
        candidate.kill()
    lines = record_lines(record)
    assert all(line["success"] for line in lines if line["endpoint"] == "primary")

    def ends(side: str, keys: range) -> list[float]:
        return [line["start"] + line["latency"] for line in lines
                if line["endpoint"] == side and line["key"] in keys]

    shadows = sorted((line for line in lines if line["endpoint"] == "candidate"),
                     key=lambda line: line["key"])
    for keys in (range(16), range(48, 64)):  # the candidate up: every user served before
        assert [line["success"] for line in shadows if line["key"] in keys] == [True] * 16
        assert max(ends("primary", keys)) < min(ends("candidate", keys))  # any shadow ended
    assert {line["error_kind"] for line in shadows[32:48]} == {"connection"}
    assert {line["error_kind"] for line in shadows if not line["success"]} <= {
        "connection", "dropped", "protocol"}


def test_split_serves_about_the_fraction_from_the_candidate(tmp_path):
    record = tmp_path / "ab.jsonl"
    bodies = [completion(f"user {i}", 3) for i in range(120)]
    with FakeServer() as primary, FakeServer() as candidate, ProxyServer(
            primary=primary.url, candidate=candidate.url, split=0.25, seed=3,
            record_path=str(record)) as proxy:
        expected = [httpx.post(primary.url + "/v1/completions", json=b).content for b in bodies]
        primary.requests.clear()
        results = post_many(proxy.url, bodies)
        stats = proxy.proxy.stats_json()
    assert [(s, data) for s, data, _ in results] == [(200, e) for e in expected]
    to_candidate = len(candidate.requests)
    assert 12 <= to_candidate <= 50  # Binomial(120, 0.25): mean 30, sd 4.7
    assert len(primary.requests) == 120 - to_candidate
    assert stats["split_to_candidate"] == to_candidate and stats["split_fallbacks"] == 0
    sides = [line["endpoint"] for line in record_lines(record)]
    assert sides.count("candidate") == to_candidate and len(sides) == 120


@pytest.mark.parametrize("failure", ["dead", "503"])
def test_split_falls_back_to_the_primary_when_the_candidate_fails_first(tmp_path, failure):
    record = tmp_path / "ab.jsonl"
    failing = FakeServer()

    @failing.app.middleware("http")
    async def unavailable(request, call_next):
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

    bodies = [completion(f"user {i}", 4) for i in range(30)]
    with FakeServer() as primary, failing:
        candidate_url = f"http://127.0.0.1:{free_port()}" if failure == "dead" else failing.url
        with ProxyServer(primary=primary.url, candidate=candidate_url, split=0.5,
                         record_path=str(record)) as proxy:
            results = post_many(proxy.url, bodies)
            stats = proxy.proxy.stats_json()
        expected = [httpx.post(primary.url + "/v1/completions", json=b).content for b in bodies]
    assert [(s, data) for s, data, _ in results] == [(200, e) for e in expected]
    assert stats["split_fallbacks"] == stats["split_to_candidate"] > 0
    lines = record_lines(record)
    assert sum(line["endpoint"] == "primary" and line["success"] for line in lines) == 30
    failures = [line for line in lines if line["endpoint"] == "candidate"]
    assert len(failures) == stats["split_fallbacks"]
    assert {line["error_kind"] for line in failures} == {
        "connection" if failure == "dead" else "http"}


def test_read_proxy_record_joins_proxy_starts_and_names_bad_lines(tmp_path):
    def header(started_at: float) -> dict:
        return {"kind": "ab-proxy", "primary": "http://a", "candidate": "http://b",
                "mode": "mirror", "split": None, "started_at": started_at}

    def line(side: str, key: int, start: float, latency: float) -> dict:
        return {"endpoint": side, "key": key, "start": start, "latency": latency,
                "success": True}

    path = tmp_path / "ab.jsonl"
    rows = [header(100.0), line("primary", 0, 1.0, 2.0), line("candidate", 0, 1.0, 1.0),
            line("primary", 1, 2.0, 0.5), header(110.0), line("primary", 0, 0.5, 1.0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"endpoint": "prim')
    result = read_proxy_record(str(path))
    assert [(r["endpoint"], r["key"], r["start"]) for r in result["requests"]] == [
        ("primary", 0, 1.0), ("candidate", 0, 1.0), ("primary", 1, 2.0), ("primary", 2, 10.5)]
    assert result["duration"] == {"primary": pytest.approx(10.5), "candidate": 1.0}
    assert result["config"]["proxy_starts"] == 2

    path.write_text(json.dumps(header(0)) + "\nnot json\n" + json.dumps(header(1)) + "\n")
    with pytest.raises(BenchError, match=r"ab\.jsonl:2: not a JSON line"):
        read_proxy_record(str(path))
    path.write_text(json.dumps(line("primary", 0, 0, 1)) + "\n")
    with pytest.raises(BenchError, match=r":1: not a line of an ab-proxy record"):
        read_proxy_record(str(path))


def test_a_record_that_cannot_be_written_stops_with_one_warning(caplog):
    writer = RecordWriter("/dev/full", {"kind": "ab-proxy"})  # every write: ENOSPC
    for i in range(5):
        writer.write({"endpoint": "primary", "key": i})
    writer.close()
    assert writer.disabled
    assert len([r for r in caplog.records if "recording stops" in r.getMessage()]) == 1


@pytest.mark.parametrize("args, message", [
    (["--primary", "localhost:8000", "--mirror"], "--primary 'localhost:8000'"),
    (["--primary", "http://127.0.0.1:1", "--split", "0"], "--split must be a fraction in (0, 1)"),
    (["--primary", "http://127.0.0.1:1", "--split", "1.5"], "--split must be a fraction"),
    (["--primary", "http://127.0.0.1:8080", "--mirror"], "this proxy's own address"),
    (["--primary", "http://127.0.0.1:1", "--mirror", "--max-shadow-in-flight", "0"],
     "--max-shadow-in-flight must be >= 1"),
    (["--primary", "http://127.0.0.1:1", "--mirror", "--record", "/no/such/dir/ab.jsonl"],
     "--record /no/such/dir/ab.jsonl: cannot open it"),
])
def test_cli_bad_flags_exit_2_with_one_line(capsys, args, message):
    assert main(["ab-proxy", "--candidate", "http://127.0.0.1:2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error:") and message in err and "Traceback" not in err


def test_cli_mirror_and_split_together_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ab-proxy", "--primary", "http://a:1", "--candidate", "http://b:2", "--mirror",
              "--split", "0.1"])
    assert exit_info.value.code == 2
    assert "not allowed with argument --mirror" in capsys.readouterr().err


def test_cli_starts_with_an_unreachable_primary_and_answers_502():
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda", "ab-proxy", "--primary", dead, "--candidate", dead,
         "--mirror", "--port", str(port)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 30
        while True:
            try:
                stats = httpx.get(f"http://127.0.0.1:{port}/ab-proxy/stats", timeout=1).json()
                break
            except httpx.HTTPError:
                assert time.time() < deadline and process.poll() is None
                time.sleep(0.1)
        assert stats["mode"] == "mirror"
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=completion("x"))
        assert response.status_code == 502 and "did not answer" in response.json()["error"][
            "message"]
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert "the primary" in err and "does not answer yet" in err and "Traceback" not in err


def test_the_upstream_client_reuses_connections_and_survives_servers_that_close_them(
        monkeypatch):
    """proxy_upstream.py against a raw server: keep-alive reuse, a kept connection the
    server closed (sent again on a fresh one), a body ended by the close, a cut-off body."""
    # A kept connection looks usable: the request goes out on it, and finds it closed.
    monkeypatch.setattr(proxy_upstream._Connection, "usable", lambda self: True)
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",       # kept open
               b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nbye",         # then closed
               b"HTTP/1.0 200 OK\r\n\r\nuntil the end",                     # ends at the close
               b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\nshort"]      # cut off
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        while answers:
            if not await reader.readuntil(b"\r\n\r\n"):
                break
            answer = answers.pop(0)
            writer.write(answer)
            await writer.drain()
            if not answer.startswith(b"HTTP/1.1 200 OK\r\ncontent-length: 5"):
                writer.close()
                return

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        upstream = Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", 5.0)
        bodies = []
        for _ in range(3):
            response = await upstream.open("GET", "/x", [], b"")
            bodies.append(b"".join([piece async for piece in response.chunks()]))
            await response.aclose()
            await asyncio.sleep(0.05)  # let the server's close arrive
        response = await upstream.open("GET", "/x", [], b"")
        with pytest.raises(UpstreamError) as error:
            _ = [piece async for piece in response.chunks()]
        await response.aclose()
        await upstream.aclose()
        server.close()
        return bodies, error.value.kind

    bodies, kind = asyncio.run(run())
    assert bodies == [b"hello", b"bye", b"until the end"] and kind == "dropped"
    assert len(connections) == 3  # the first two answers shared one connection


def test_bench_ab_reports_on_a_live_mirror_record(tmp_path, capsys):
    """`pagoda bench ab --from-record` on the proxy's own record: the candidate, which
    streams 4x faster, is found faster end to end and per token, with intervals."""
    from pagoda.cli.main import main

    record, out = tmp_path / "ab.jsonl", tmp_path / "ab.json"
    with FakeServer(delay=0.02) as primary, FakeServer(delay=0.005) as candidate, ProxyServer(
            primary=primary.url, candidate=candidate.url, mirror=True,
            record_path=str(record)) as proxy:
        for start in range(0, 24, 8):
            results = post_many(proxy.url, [completion(f"q{i}", max_tokens=8)
                                            for i in range(start, start + 8)])
            assert all(status == 200 for status, _, _ in results)
        proxy.wait_for_shadows()
    time.sleep(0.5)  # the record is written in batches
    assert main(["bench", "ab", "--from-record", str(record), "--resamples", "500",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    [comparison] = result["analysis"]["comparisons"]
    assert (comparison["baseline"], comparison["candidate"]) == ("primary", "candidate")
    assert comparison["paired"] and comparison["num_pairs"] == 24
    assert comparison["resampled"] == "requests"  # a live record has no replay blocks
    tpot = next(m for m in comparison["metrics"]
                if m["metric"] == "tpot" and m["statistic"] == "median")
    assert tpot["difference"] < -0.5 and tpot["significant"]
    assert comparison["output_agreement"]["share"] == 1.0
    assert result["analysis"]["choice"] == "candidate"
    assert "choose candidate" in capsys.readouterr().out.replace("\n", " ")

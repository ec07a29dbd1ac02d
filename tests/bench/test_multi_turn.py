"""`pagoda bench serve --dataset multi-turn`: users whose every turn re-sends the shared system
prompt and the whole history with the server's real replies, turns of a user one after the
other, users side by side; TTFT per turn in the summary, the text report and `bench compare`;
bad flags exit 2."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from pagoda.bench import datasets, report
from pagoda.bench.metrics import RequestRecord, summarize
from pagoda.cli.main import main
from tests.helpers.fake_server import FakeServer
from tests.helpers.ports import free_port

USERS, TURNS, SYSTEM_LEN, INPUT_LEN, OUTPUT_LEN = 4, 3, 24, 8, 3


def test_the_system_prompt_is_shared_sized_and_seeded(bundled_tokenizer):
    conversations = datasets.multi_turn_dataset(bundled_tokenizer, 6, num_turns=3, input_len=8,
                                                output_len=2, seed=5, system_prompt_len=40)
    assert [len(c.turns) for c in conversations] == [3, 3]
    systems = [c.history for c in conversations]
    assert systems[0] == systems[1] and systems[0][0]["role"] == "system"
    assert len(bundled_tokenizer.encode(systems[0][0]["content"],
                                        add_special_tokens=False)) == 40
    again = datasets.multi_turn_dataset(bundled_tokenizer, 6, 3, 8, 2, seed=5,
                                        system_prompt_len=40)
    assert [(c.history, c.turns) for c in again] == [(c.history, c.turns) for c in conversations]
    other = datasets.multi_turn_dataset(bundled_tokenizer, 6, 3, 8, 2, seed=6,
                                        system_prompt_len=40)
    assert other[0].history != conversations[0].history
    # no system prompt: no history (the workload the flag did not exist for is unchanged)
    plain = datasets.multi_turn_dataset(bundled_tokenizer, 6, 3, 8, 2, seed=5)
    assert all(c.history == [] for c in plain)


def reply_of(number: int) -> str:
    """What the fake server (unique_replies) streams for its request `number`."""
    return "".join(f" r{number}w{i}" for i in range(OUTPUT_LEN))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_turn_carries_the_history_with_the_real_replies(endpoint, bundled_tokenizer,
                                                             tmp_path, capsys):
    out = tmp_path / "r.json"
    with FakeServer(delay=0.01, unique_replies=True) as server:
        assert main(["bench", "serve", "--no-progress", "--num-warmups", "0",
                     "--base-url", server.url, "--endpoint", endpoint, "--dataset", "multi-turn",
                     "--num-users", str(USERS), "--num-turns", str(TURNS),
                     "--system-prompt-len", str(SYSTEM_LEN), "--input-len", str(INPUT_LEN),
                     "--output-len", str(OUTPUT_LEN), "--max-concurrency", "2", "--seed", "3",
                     "--output", str(out)]) == 0
        bodies = list(server.requests)
        spans = list(server.app.state.spans)
        max_in_flight = server.app.state.max_in_flight
    assert len(bodies) == USERS * TURNS
    # the workload the command built (same tokenizer, same seed)
    conversations = datasets.multi_turn_dataset(bundled_tokenizer, USERS * TURNS, TURNS,
                                                INPUT_LEN, OUTPUT_LEN, seed=3,
                                                system_prompt_len=SYSTEM_LEN)
    assert len(conversations) == USERS
    system = conversations[0].history[0]["content"]

    def request_text(body: dict) -> str:
        if endpoint == "chat":
            return json.dumps(body["messages"])
        return body["prompt"]

    index_of = {request_text(b): n for n, b in enumerate(bodies)}
    assert len(index_of) == len(bodies)  # every request differs
    for c in conversations:
        # follow the user turn by turn: each request is the previous one, the server's reply
        # to it exactly, and the new user message
        messages = [{"role": "system", "content": system}, {"role": "user", "content": c.turns[0]}]
        for turn in range(TURNS):
            expected = (json.dumps(messages) if endpoint == "chat"
                        else "".join(m["content"] for m in messages))
            assert expected in index_of, f"turn {turn} of a user was not sent as expected"
            number = index_of[expected]
            assert bodies[number]["max_tokens"] == OUTPUT_LEN
            if turn + 1 < TURNS:
                messages += [{"role": "assistant", "content": reply_of(number)},
                             {"role": "user", "content": c.turns[turn + 1]}]

    # a user's turns never overlap; users do run side by side, within --max-concurrency
    def user_of(body: dict) -> int:
        if endpoint == "chat":
            return next(i for i, c in enumerate(conversations)
                        if body["messages"][1]["content"] == c.turns[0])
        return next(i for i, c in enumerate(conversations)
                    if body["prompt"].startswith(system + c.turns[0]))

    by_user: dict[int, list[tuple[float, float]]] = {}
    for body, start, end in spans:
        by_user.setdefault(user_of(body), []).append((start, end))
    assert len(by_user) == USERS and all(len(v) == TURNS for v in by_user.values())
    for times in by_user.values():
        times.sort()
        for (_, end), (next_start, _) in itertools.pairwise(times):
            assert next_start >= end
    assert max_in_flight == 2

    # per-turn TTFT: computed from the requests of that turn
    run = json.loads(out.read_text())["runs"][0]
    summary, records = run["summary"], run["requests"]
    assert summary["completed"] == USERS * TURNS
    assert [t["turn"] for t in summary["ttft_by_turn_s"]] == list(range(1, TURNS + 1))
    for t in summary["ttft_by_turn_s"]:
        ttfts = [r["ttft"] for r in records if r["turn"] == t["turn"] - 1]
        assert t["requests"] == USERS == len(ttfts)
        assert t["mean"] == pytest.approx(np.mean(ttfts))
        assert t["p95"] == pytest.approx(np.percentile(ttfts, 95))
    later = [r["ttft"] for r in records if r["turn"] >= 1]
    assert summary["ttft_later_turns_s"]["p95"] == pytest.approx(np.percentile(later, 95))
    assert run["requests"][0]["conversation"] == 0
    config = json.loads(out.read_text())["config"]
    assert config["num_requests"] == USERS * TURNS and config["num_users"] == USERS
    printed = capsys.readouterr().out
    assert "TTFT by turn (ms)" in printed
    assert all(f"turn {t}" in printed for t in range(1, TURNS + 1)) and "turns >= 2" in printed


def record(turn: int, ttft: float | None, success: bool = True) -> RequestRecord:
    r = RequestRecord(index=0, turn=turn, conversation=0, success=success, latency=1.0)
    if ttft is not None:
        r.chunk_times = [ttft, ttft + 0.01]
    return r


def test_per_turn_figures_use_only_that_turns_successful_requests():
    turn1 = [0.30, 0.10, 0.50, 0.20]
    turn2 = [0.01, 0.02, 0.09]
    records = ([record(0, t) for t in turn1] + [record(1, t) for t in turn2]
               + [record(1, 9.0, success=False), record(2, None, success=False)])
    summary = summarize(records, duration=2.0)
    first, second, third = summary["ttft_by_turn_s"]
    assert (first["turn"], first["requests"]) == (1, 4)
    assert first["median"] == pytest.approx(np.median(turn1))
    assert first["p95"] == pytest.approx(np.percentile(turn1, 95))
    assert second["requests"] == 3 and second["mean"] == pytest.approx(np.mean(turn2))
    assert second["p95"] == pytest.approx(np.percentile(turn2, 95))  # the failed 9 s left out
    assert third["requests"] == 0 and third["p95"] is None
    assert summary["ttft_later_turns_s"]["p95"] == pytest.approx(np.percentile(turn2, 95))
    text = report.format_serve_summary(summary, "t")
    assert "turn 3" in text and "turns >= 2" in text
    sweep = report.format_sweep([{"request_rate": "inf", "max_concurrency": 2,
                                  "summary": summary}]).splitlines()
    assert sweep[0].rstrip(" |").endswith("TTFT p95 turns>=2 ms")
    assert sweep[2].rstrip(" |").endswith(f"{np.percentile(turn2, 95) * 1000:.1f}")
    # single-turn workloads carry no per-turn figures
    assert "ttft_by_turn_s" not in summarize([record(0, 0.1)], duration=1.0)


def serve_result(label: str, turn_ttfts: list[list[float]] | None) -> dict:
    records = []
    for turn, values in enumerate(turn_ttfts or [[0.1]]):
        records += [record(turn, v) for v in values]
    result = report.envelope("serve", label, {})
    result["label"] = label
    summary = summarize(records, duration=1.0)
    result["runs"] = [{"request_rate": "inf", "max_concurrency": 4, "summary": summary,
                       "requests": [r.to_json() for r in records]}]
    return result


def test_compare_shows_the_turns_side_by_side(tmp_path, capsys):
    paths = []
    for name, turns in [("notiers", [[0.4, 0.6], [0.8, 1.0]]),
                        ("tiers", [[0.4, 0.6], [0.2, 0.25]]),
                        ("single", None)]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(serve_result(name, turns)))
        paths.append(str(path))
    assert main(["bench", "compare", *paths]) == 0
    table = capsys.readouterr().out
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header == ["metric", "notiers", "tiers", "single"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in table.splitlines()[2:] if line.startswith("|")}
    assert rows["TTFT turn 1 mean ms"] == ["500.0", "500.0 (×1.00)", "-"]
    assert rows["TTFT turn 2 mean ms"] == ["900.0", "225.0 (×0.25)", "-"]
    p95 = np.percentile([0.2, 0.25], 95) / np.percentile([0.8, 1.0], 95)
    assert rows["TTFT turn 2 P95 ms"][1].endswith(f"(×{p95:.2f})")
    assert rows["TTFT turns>=2 P95 ms"][0] == f"{np.percentile([0.8, 1.0], 95) * 1000:.1f}"
    assert "TTFT turn 3 mean ms" not in rows


@pytest.mark.parametrize("args, message", [
    (["--num-users", "0"], "--num-users"),
    (["--num-users", "-3"], "--num-users"),
    (["--num-turns", "0"], "--num-turns"),
    (["--system-prompt-len", "-1"], "--system-prompt-len"),
    (["--num-users", "2", "--num-turns", "3", "--num-requests", "5"], "disagrees"),
    (["--dataset", "random", "--num-users", "2"], "multi-turn only"),
    (["--dataset", "random", "--system-prompt-len", "100"], "multi-turn only"),
])
def test_bad_multi_turn_flags_exit_2(args, message, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}",
               "--dataset", "multi-turn", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and message in err, err
